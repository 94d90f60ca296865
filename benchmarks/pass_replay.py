"""Exact replay of HistoSpec's forward passes from a run's saved rollouts (issue 4 analysis).

Given the tokens a sequence emitted, the number of verify passes HistoSpec needed for it is fixed:
a draft token is accepted exactly when it equals the emitted token at its position (a rejected
draft token is resampled from the residual, which excludes it), so each pass emits the longest
common prefix of draft and emitted tokens plus one. Replaying the run's own drafter settings
(suffix index over the previous rollout of the prompt, branch policy, window policy, self-lookup)
over ``<run>/rollouts/step_*.npz`` gives every sequence's pass count without a model:

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
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rhyme_jax.config import load_config  # noqa: E402
from rhyme_jax.data import load_problems  # noqa: E402
from rhyme_jax.spec.drafter import SELF_LOOKUP_WIDTH  # noqa: E402
from rhyme_jax.spec.self_lookup import self_lookup_drafts  # noqa: E402
from rhyme_jax.spec.suffix_index import SuffixIndex  # noqa: E402
from rhyme_jax.spec.window import initial_window, next_window  # noqa: E402
from rhyme_jax.train.policy import build_tokenizer  # noqa: E402
from rhyme_jax.io.rollout_log import list_rollout_steps, load_rollouts  # noqa: E402
from rhyme_jax.train.trainer import epoch_of_step  # noqa: E402


def replay_step(spec, max_new: int, prompts, pids, responses, rewards, history, siblings: bool):
    """Passes per sequence of one step (all sequences start together after one prefill).

    Returns ``int[N]`` verify passes of each sequence after the prefill pass, which emitted its
    first token."""
    n = len(responses)
    lengths = np.array([len(r) for r in responses])
    pos = np.minimum(1, lengths)  # the prefill pass samples each first token
    passes = np.zeros(n, np.int64)
    finished_at = np.full(n, np.iinfo(np.int64).max)
    window = initial_window(spec.window, n, spec.fixed_window)
    indexes: dict[tuple, SuffixIndex | None] = {}
    t = 0
    while (pos < lengths).any():
        t += 1
        for i in np.flatnonzero(pos < lengths):
            pid, y = int(pids[i]), responses[i]
            done = tuple(j for j in range(n) if siblings and pids[j] == pid and finished_at[j] < t)
            if (pid, done) not in indexes:
                old, old_rewards = history.get(pid, ([], []))
                resp = list(old) + [responses[j] for j in done]
                rew = np.array(list(old_rewards) + [rewards[j] for j in done], np.float32)
                indexes[(pid, done)] = SuffixIndex.build(prompts[pid], resp, rew) if resp else None
            index = indexes[(pid, done)]
            context = np.concatenate([prompts[pid], y[: pos[i]]])
            budget = int(min(window[i], max_new - pos[i] - 1))
            draft = np.zeros(0, np.int32)
            if index is not None and budget > 0:
                draft = index.draft(context[-spec.pattern_max:], budget, branch=spec.branch,
                                    min_token_prob=spec.min_token_prob, pattern_max=spec.pattern_max,
                                    pattern_min=spec.pattern_min)
            if draft.size == 0 and spec.self_lookup and budget > 0:
                tail = np.full((1, SELF_LOOKUP_WIDTH), -1, np.int64)
                c = context[-SELF_LOOKUP_WIDTH:]
                tail[0, -c.size:] = c
                own, own_len = self_lookup_drafts(tail, np.array([budget]), pattern_max=spec.pattern_max,
                                                  pattern_min=spec.pattern_min, max_draft=32)
                draft = own[0, : own_len[0]]
            rest = y[pos[i]:]
            m = min(draft.size, rest.size)
            accepted = int(np.argmin(np.append(draft[:m] == rest[:m], False)))
            pos[i] += min(accepted + 1, rest.size)
            passes[i] += 1
            window[i: i + 1] = next_window(spec.window, window[i: i + 1], np.array([draft.size]),
                                           np.array([accepted]), spec.fixed_window)
            if pos[i] >= y.size:
                finished_at[i] = t
    return passes


def oracle_passes(prompt: np.ndarray, response: np.ndarray, sources: list[np.ndarray], max_new: int,
                  window: int, pattern_max: int = 7, pattern_min: int = 3) -> int:
    """Verify passes of one sequence if every pass accepted the longest match among all
    continuations (at most ``window`` tokens) of the context's longest suffix of
    ``pattern_max``..``pattern_min`` tokens found in ``sources`` (prompt + a history response) or in
    the context itself (brute force; an upper bound on any drafter over these sources)."""
    pos, passes = min(1, response.size), 0
    while pos < response.size:
        ctx = np.concatenate([prompt, response[:pos]])
        rest = response[pos:]
        budget = int(min(window, max_new - pos - 1))
        best = 0
        for k in range(min(pattern_max, ctx.size - 1), pattern_min - 1, -1):
            pattern = ctx[-k:]
            # the sources, then the context's own earlier occurrences (not the one ending it)
            for src, searched in [*((x, x) for x in sources), (ctx, ctx[:-1])]:
                if searched.size < k:
                    continue
                windows = np.lib.stride_tricks.sliding_window_view(searched, k)
                for j in np.flatnonzero((windows == pattern).all(axis=1)):
                    cont = src[j + k: j + k + budget]
                    m = min(cont.size, rest.size)
                    best = max(best, int(np.argmin(np.append(cont[:m] == rest[:m], False))))
            if best:
                break
        pos += min(best + 1, rest.size)
        passes += 1
    return passes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="run directory with config.yaml, tokenizer.json and rollouts/")
    ap.add_argument("--from-epoch", type=int, default=3, help="report steps of this epoch on")
    ap.add_argument("--siblings", action="store_true", help="also draft from finished responses of the same step")
    ap.add_argument("--oracle", action="store_true", help="upper bound: best continuation among all matches")
    ap.add_argument("--oracle-window", type=int, default=32)
    args = ap.parse_args(argv)
    run = Path(args.run)
    if not (run / "config.yaml").is_file():
        print(f"benchmarks/pass_replay.py: {run / 'config.yaml'}: no such file", file=sys.stderr)
        return 2
    cfg = load_config(str(run / "config.yaml"), [])
    train, _ = load_problems(cfg.data)
    tok = build_tokenizer(cfg, run, train)
    prompt_cache: dict[int, np.ndarray] = {}

    def prompt(pid: int) -> np.ndarray:
        if pid not in prompt_cache:
            text = tok.format_prompt(cfg.model.prompt_template, train[pid].question)
            prompt_cache[pid] = np.array(tok.encode(text), np.int32)
        return prompt_cache[pid]

    history: dict[int, tuple[list, list]] = {}  # depth-1 history, written back after each step
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
                                                     for h in history.get(int(p), ([], []))[0]],
                                                 cfg.rollout.max_new_tokens, args.oracle_window)
                                   for p, y in zip(pids, resp)])
            else:
                passes = replay_step(cfg.spec, cfg.rollout.max_new_tokens, prompts, pids, resp, rew, history,
                                     args.siblings)
            lengths = np.array([len(r) for r in resp])
            rows.append(dict(step=step, epoch=epoch, longest=int(lengths.max()), most_passes=int(passes.max()),
                             tokens=int(lengths.sum()), sequence_passes=int(passes.sum()) + len(resp)))  # + prefills
        for p in np.unique(pids):
            m = np.flatnonzero(pids == p)
            history[int(p)] = ([resp[j] for j in m], [float(rew[j]) for j in m])
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
