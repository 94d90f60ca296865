"""Exact replay of HistoSpec's forward passes from a run's saved rollouts (issue 4 analysis).

Given the tokens a sequence emitted, the number of verify passes HistoSpec needed for it is fixed:
a draft token is accepted exactly when it equals the emitted token at its position (a rejected
draft token is resampled from the residual, which excludes it), so each pass emits the longest
common prefix of draft and emitted tokens plus one. Running the run's own drafter
(``rhyme_jax.spec.drafter`` with the run's ``spec`` settings, over a history store written back
step by step as the trainer writes it) over ``<run>/rollouts/step_*.npz`` gives every sequence's
pass count without a model:

* per-sequence ratio: generated tokens / sequence passes, prefill included (tokens per sequence
  forward pass; plain decode: 1);
* batch ratio: plain decode's forward passes (one prefill + longest - 1 decode passes) / HistoSpec's
  (one prefill + the most verify passes of any sequence): one batch pass waits for its slowest row.

On the demo the replay reproduces the engine's HistoSpec forward passes step for step.

``--siblings`` also drafts from the responses of the same prompt that already finished in the
same step (a variant: does the tail gain from its group?). ``--oracle`` gives an upper bound for
any drafter over the same sources, tree drafts with tree verification included: every pass
accepts the longest continuation, up to ``--oracle-window`` tokens, that follows an occurrence of
the context's last 7..3 tokens (the longest suffix that occurs anywhere) in the previous rollout's
responses or in the sequence itself. The replay ignores preemption, the
verify token budget and page limits (the demo hits none of them).

Usage::

    python benchmarks/pass_replay.py runs/bench_rollout            # a run with HistoSpec on
    python benchmarks/pass_replay.py runs/bench_rollout --siblings --from-epoch 3
    python benchmarks/pass_replay.py runs/demo --set spec.window=goodput --set spec.pattern_min=1 \
        --set spec.siblings=true --set spec.min_token_prob=0     # the goodput drafter's sources

With ``spec.window=goodput`` every proposed draft token is sent (the engine would send only those
that pay for their step), so the replay bounds what the goodput sources can save in passes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rhyme_jax.config import SpecSection, load_config  # noqa: E402
from rhyme_jax.data import load_problems  # noqa: E402
from rhyme_jax.io.rollout_log import list_rollout_steps, load_rollouts  # noqa: E402
from rhyme_jax.spec.drafter import Drafter  # noqa: E402
from rhyme_jax.spec.history import HistoryEntry, HistoryStore, Rollout  # noqa: E402
from rhyme_jax.train.policy import build_tokenizer  # noqa: E402
from rhyme_jax.train.prompts import PromptTokens, epoch_of_step  # noqa: E402


class _WithSiblings:
    """The history store as the drafter sees it under ``--siblings``: each prompt's entry plus one
    more rollout holding the responses of its samples that already finished in this step
    (``finish``); entries are rebuilt only when that set changes."""

    def __init__(self, history: HistoryStore, prompts: dict, responses, rewards):
        self.history, self.prompts, self.responses, self.rewards = history, prompts, responses, rewards
        self.done: dict[int, list[int]] = {}
        self._entries: dict[int, tuple[tuple, HistoryEntry | None]] = {}

    def finish(self, pid: int, row: int) -> None:
        self.done.setdefault(int(pid), []).append(int(row))

    def entry(self, pid: int) -> HistoryEntry | None:
        pid = int(pid)
        done = tuple(sorted(self.done.get(pid, ())))
        if pid not in self._entries or self._entries[pid][0] != done:
            old = self.history.entry(pid)
            rollouts = old.rollouts if old is not None else ()
            if done:
                resp = tuple(np.asarray(self.responses[j], np.int32) for j in done)
                rollouts += (Rollout(-1, resp, np.array([self.rewards[j] for j in done], np.float32),
                                     np.array([r.size for r in resp], np.int32)),)
            prompt = old.prompt if old is not None else np.asarray(self.prompts[pid], np.int32)
            self._entries[pid] = (done, HistoryEntry(prompt, rollouts) if rollouts else None)
        return self._entries[pid][1]


def replay_step(spec, max_new: int, prompts, pids, responses, rewards, history: HistoryStore,
                siblings: bool) -> np.ndarray:
    """Passes per sequence of one step (all sequences start together after one prefill), drafted
    by the run's own drafter (``rhyme_jax.spec.drafter``: one ``DraftBatch`` over ``history`` for
    the step, ``draft`` / ``observe`` after every pass as the engine calls them; with
    ``siblings``, over the history plus the same prompt's responses finished in earlier passes).

    Args:
      spec: the ``spec`` config section; ``max_new``: ``rollout.max_new_tokens``.
      prompts: prompt id -> ``int32[p]`` prompt tokens; ``pids``: ``int[N]`` prompt id per row.
      responses, rewards: the step's emitted ``int32[L_i]`` responses and their rewards.
      history: the history store as the trainer held it when the step ran.

    Returns ``int[N]`` verify passes of each sequence after the prefill pass, which emitted its
    first token."""
    n = len(responses)
    lengths = np.array([len(r) for r in responses])
    pos = np.minimum(1, lengths)  # the prefill pass samples each first token
    passes = np.zeros(n, np.int64)
    store = _WithSiblings(history, prompts, responses, rewards) if siblings else history
    drafter = Drafter(spec, store)
    try:
        batch, log = drafter.batch(pids), []
        while (pos < lengths).any():
            live = np.flatnonzero(pos < lengths)
            width = batch.context_width
            tails = np.full((live.size, width), -1, np.int64)
            for b, i in enumerate(live):
                c = np.concatenate([prompts[int(pids[i])], responses[i][: pos[i]]])[-width:]
                tails[b, width - c.size:] = c
            drafts, lens = batch.draft(live, tails, max_new - pos[live] - 1)
            accepted = np.zeros(live.size, np.int64)
            for b, i in enumerate(live):
                rest = responses[i][pos[i]:]
                m = min(int(lens[b]), rest.size)
                accepted[b] = int(np.argmin(np.append(drafts[b, :m] == rest[:m], False)))
                pos[i] += min(accepted[b] + 1, rest.size)
            passes[live] += 1
            batch.observe(live, lens, accepted)
            log.append((live, lens, accepted))
            ended = live[pos[live] >= lengths[live]]
            if siblings and ended.size:  # their responses become draft sources from the next pass on
                for i in ended:
                    store.finish(pids[i], i)
                batch = drafter.batch(pids)
                for step_obs in log:  # the windows are a function of the observations: replay them
                    batch.observe(*step_obs)
    finally:
        drafter.close()
    return passes


def oracle_passes(prompt: np.ndarray, response: np.ndarray, sources: list[np.ndarray], max_new: int,
                  window: int, pattern_max: int = SpecSection.pattern_max,
                  pattern_min: int = SpecSection.pattern_min) -> int:
    """Verify passes of one sequence if every pass accepted the longest match among all
    continuations (at most ``window`` tokens) of the context's longest suffix of
    ``pattern_max``..``pattern_min`` tokens found in ``sources`` (prompt + a history response) or in
    the context itself (brute force; an upper bound on any drafter over these sources)."""
    pos, passes = min(1, response.size), 0
    while pos < response.size:
        ctx = np.concatenate([prompt, response[:pos]])
        rest = response[pos: pos + int(min(window, max_new - pos - 1))]
        best = best_continuation(ctx, rest, sources, pattern_max, pattern_min, longest_only=True)
        pos += min(best + 1, response.size - pos)
        passes += 1
    return passes


def best_continuation(ctx: np.ndarray, rest: np.ndarray, sources: list[np.ndarray], pattern_max: int,
                      pattern_min: int, longest_only: bool) -> int:
    """Longest prefix of ``rest`` that follows an occurrence of the context's last ``k`` tokens
    (``k`` from ``pattern_max`` down to ``pattern_min``) in a source or in ``ctx`` itself (not
    the occurrence ending it); ``longest_only``: stop at the longest ``k`` that gives anything."""
    best = 0
    for k in range(min(pattern_max, ctx.size - 1), pattern_min - 1, -1):
        pattern = ctx[-k:]
        for src, searched in [*((x, x) for x in sources), (ctx, ctx[:-1])]:
            if searched.size < k:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(searched, k)
            for j in np.flatnonzero((windows == pattern).all(axis=1)):
                cont = src[j + k: j + k + rest.size]
                m = min(cont.size, rest.size)
                best = max(best, int(np.argmin(np.append(cont[:m] == rest[:m], False))))
        if best and longest_only:
            break
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="run directory with config.yaml, tokenizer.json and rollouts/")
    ap.add_argument("--from-epoch", type=int, default=3, help="report steps of this epoch on")
    ap.add_argument("--siblings", action="store_true", help="also draft from finished responses of the same step")
    ap.add_argument("--oracle", action="store_true", help="upper bound: best continuation among all matches")
    ap.add_argument("--oracle-window", type=int, default=32)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override the run's config, e.g. spec.window=goodput (the goodput drafter's sources, "
                    "every drafted token sent: its bound without the engine's cost-aware cuts)")
    args = ap.parse_args(argv)
    run = Path(args.run)
    if not (run / "config.yaml").is_file():
        print(f"benchmarks/pass_replay.py: {run / 'config.yaml'}: no such file", file=sys.stderr)
        return 2
    cfg = load_config(str(run / "config.yaml"), args.overrides)
    train, _ = load_problems(cfg.data)
    tokens = PromptTokens(build_tokenizer(cfg, run, train), train, cfg.model.prompt_template)

    def prompt(pid: int) -> np.ndarray:
        return np.array(tokens(pid), np.int32)

    history = HistoryStore(cfg.spec.history_depth)  # written back after each step, as the trainer does
    rows = []
    for step in list_rollout_steps(run):
        ro = load_rollouts(run, step)
        pids, resp, rew = ro["prompt_ids"], ro["responses"], ro["rewards"]
        epoch = epoch_of_step(cfg, len(train), step)
        if epoch >= args.from_epoch:
            prompts = {int(p): prompt(int(p)) for p in np.unique(pids)}
            if args.oracle:
                passes = np.array([oracle_passes(prompts[int(p)], y, [prompts[int(p)]] + [
                                                     np.concatenate([prompts[int(p)], h])
                                                     for h in (history.responses(int(p))[0] if int(p) in history else [])],
                                                 cfg.rollout.max_new_tokens, args.oracle_window)
                                   for p, y in zip(pids, resp)])
            else:
                passes = replay_step(cfg.spec, cfg.rollout.max_new_tokens, prompts, pids, resp, rew, history,
                                     args.siblings)
            lengths = np.array([len(r) for r in resp])
            rows.append(dict(step=step, epoch=epoch, longest=int(lengths.max()), most_passes=int(passes.max()),
                             tokens=int(lengths.sum()), sequence_passes=int(passes.sum()) + len(resp)))  # + prefills
        history.update(step, pids, [prompt(int(p)) for p in pids], resp, rew)
    if not rows:
        print(f"benchmarks/pass_replay.py: no steps of epoch >= {args.from_epoch} in {run}", file=sys.stderr)
        return 2
    # forward passes as the engine counts them: + 1 prefill; plain decode needs longest - 1 decode passes
    batch = sum(r["longest"] for r in rows) / sum(r["most_passes"] + 1 for r in rows)
    per_seq = sum(r["tokens"] for r in rows) / sum(r["sequence_passes"] for r in rows)
    summary = dict(run=str(run), siblings=args.siblings, oracle=args.oracle, steps=len(rows), batch_ratio=batch, per_sequence_ratio=per_seq)
    print(json.dumps(summary))
    for r in rows:
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
