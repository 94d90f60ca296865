"""Exact replay of HistoSpec's forward passes from a step's emitted tokens (issue 4 analysis).

Given the tokens a sequence emitted, the number of verify passes HistoSpec needed for it is fixed:
a draft token is accepted exactly when it equals the emitted token at its position (a rejected
draft token is resampled from the residual, which excludes it), so each pass emits the longest
common prefix of draft and emitted tokens plus one. ``replay_step`` runs the run's own drafter
(``rhyme_jax.spec.drafter`` with the run's ``spec`` settings, over the history store as the
trainer held it) along one step's responses through ``draft_replay.drive`` (all sequences start
together after one prefill, every drafted token is sent) and returns every sequence's passes:
on the demo the replay reproduces the engine's HistoSpec forward passes step for step
(tests/test_pass_replay.py). ``summarize`` turns per-step counts into the two ratios:

* per-sequence ratio: generated tokens / sequence passes, prefill included (tokens per sequence
  forward pass; plain decode: 1);
* batch ratio: plain decode's forward passes (one prefill + longest - 1 decode passes) / HistoSpec's
  (one prefill + the most verify passes of any sequence): one batch pass waits for its slowest row.

``oracle_passes`` is the upper bound for any drafter over the same sources, tree drafts with
tree verification included: every pass accepts the longest continuation (``best_continuation``),
up to a window, that follows an occurrence of the context's longest suffix of ``pattern_max`` ..
``pattern_min`` tokens in the sources or in the sequence itself. The replay ignores preemption,
the verify token budget and page limits. The run-level driver (reading a run's config, prompts
and saved rollouts) is ``rhyme_lab.ablate.saved_runs.pass_replay_run``.
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Int

from rhyme_jax.config import SpecSection
from rhyme_lab.measure.draft_replay import drive
from rhyme_lab.measure.oracle_drafters import held_run
from rhyme_jax.spec.drafter import Drafter
from rhyme_jax.spec.history import HistoryEntry, HistoryStore, Rollout


class WithSiblings:
    """The history store as the drafter sees it with siblings: each prompt's entry plus one more
    rollout holding the responses of its samples that already finished in this step
    (``finish``); entries are rebuilt only when that set changes. ``prompts``: prompt id ->
    ``int32[p]``; ``responses`` / ``rewards``: the step's."""

    def __init__(self, history: HistoryStore, prompts: dict, responses, rewards):
        self.history, self.prompts, self.responses, self.rewards = history, prompts, responses, rewards
        self.done: dict[int, list[int]] = {}
        self._entries: dict[int, tuple[tuple, HistoryEntry | None]] = {}

    def finish(self, pid: int, row: int) -> None:
        """Row ``row`` (a response of prompt ``pid``) has finished: a draft source from now on."""
        self.done.setdefault(int(pid), []).append(int(row))

    def lengths(self, pid: int) -> np.ndarray | None:
        """``int32[n]`` response lengths of the prompt's last rollout in the history (the
        drafter's length prediction; the siblings are not a rollout of the history)."""
        return self.history.lengths(int(pid))

    def entry(self, pid: int) -> HistoryEntry | None:
        """The history entry of ``pid`` with its finished siblings as one more rollout."""
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


def replay_step(spec, max_new: int, prompts: dict, pids, responses, rewards, history: HistoryStore,
                siblings: bool) -> Int[np.ndarray, "N"]:
    """Passes per sequence of one step (all sequences start together after one prefill), drafted
    by the run's own drafter (one ``DraftBatch`` over ``history`` for the step, ``draft`` /
    ``observe`` after every pass as the engine calls them; with ``siblings``, over the history
    plus the same prompt's responses finished in earlier passes).

    Args:
      spec: the ``spec`` config section; ``max_new``: ``rollout.max_new_tokens``.
      prompts: prompt id -> ``int32[p]`` prompt tokens; ``pids``: ``int[N]`` prompt id per row.
      responses, rewards: the step's emitted ``int32[L_i]`` responses and their rewards.
      history: the history store as the trainer held it when the step ran.

    Returns ``int64[N]`` verify passes of each sequence after the prefill pass, which emitted its
    first token.
    """
    store = WithSiblings(history, prompts, responses, rewards) if siblings else history
    drafter = Drafter(spec, store)
    rows = [np.asarray(prompts[int(p)]) for p in pids]
    targets = [np.asarray(r) for r in responses]
    try:
        return drive(drafter.batch(pids), rows, targets, emitted=1, max_new=max_new,
                     rebatch=sibling_rebatch(drafter, store if siblings else None, pids, targets))
    finally:
        drafter.close()


def sibling_rebatch(drafter: Drafter, store: WithSiblings | None, pids, targets, on_pass=None):
    """``drive``'s ``rebatch`` for a step replay: calls ``on_pass(live, lens, accepted, done)``
    after each pass, and with ``store`` makes the responses that just ended draft sources of
    their siblings (``WithSiblings.finish``), returning a fresh batch of ``drafter`` that has
    seen every observation so far (its windows are a function of them)."""
    log: list = []
    sizes = np.array([t.size for t in targets])

    def rebatch(live, lens, accepted, done):
        if on_pass is not None:
            on_pass(live, lens, accepted, done)
        log.append((live, lens, accepted))
        ended = live[done[live] >= sizes[live]]
        if store is None or not ended.size:
            return None
        for i in ended:  # their responses become draft sources from the next pass on
            store.finish(pids[i], i)
        batch = drafter.batch(pids)
        for obs in log:
            batch.observe(*obs)
        return batch

    return rebatch


def best_continuation(ctx: np.ndarray, rest: np.ndarray, sources: list[np.ndarray], pattern_max: int,
                      pattern_min: int, longest_only: bool) -> int:
    """Longest prefix of ``rest`` that follows an occurrence of the context's last ``k`` tokens
    (``k`` from ``pattern_max`` down to ``pattern_min``, at most ``ctx.size - 1``) in a source or
    in ``ctx`` itself (not the occurrence ending it): ``oracle_drafters.held_run`` per ``k``;
    ``longest_only``: stop at the longest ``k`` that gives anything. Token arrays, any int dtype."""
    best = 0
    for k in range(min(pattern_max, ctx.size - 1), pattern_min - 1, -1):
        best = max(best, held_run(sources, ctx, rest, k))
        if best and longest_only:
            break
    return best


def oracle_accepts(prompt: np.ndarray, response: np.ndarray, sources: list[np.ndarray], window: int,
                   pattern: tuple[int, int] = (SpecSection.pattern_max, SpecSection.pattern_min),
                   max_new: int | None = None) -> list[int]:
    """Draft tokens the oracle gets accepted at each verify pass of one sequence: every pass
    accepts ``best_continuation`` (longest suffix first, ``pattern`` = (longest, shortest)) of at
    most ``window`` tokens (and at most ``max_new - emitted - 1``, the engine's budget) over
    ``sources`` (``int32[*]`` token arrays) and the context itself.

    Args: ``prompt`` ``int32[P]``; ``response`` ``int32[L]`` the emitted tokens.
    Returns one count per verify pass after the prefill (which emitted the first token); each pass
    emits its count + 1 tokens (the last pass fewer, at the response's end).
    """
    pos, out = min(1, response.size), []
    while pos < response.size:
        ctx = np.concatenate([prompt, response[:pos]])
        cap = window if max_new is None else int(min(window, max_new - pos - 1))
        a = best_continuation(ctx, response[pos: pos + cap], sources, pattern[0], pattern[1], longest_only=True)
        out.append(int(a))
        pos += min(a + 1, response.size - pos)
    return out


def oracle_passes(prompt: np.ndarray, response: np.ndarray, sources: list[np.ndarray], max_new: int,
                  window: int, pattern_max: int = SpecSection.pattern_max,
                  pattern_min: int = SpecSection.pattern_min) -> int:
    """Verify passes of one sequence under ``oracle_accepts`` (an upper bound on any drafter over
    ``sources``: ``int32`` prompt + history response arrays)."""
    return len(oracle_accepts(prompt, response, sources, window, (pattern_max, pattern_min), max_new))


def step_row(step: int, epoch: int, responses, passes: Int[np.ndarray, "N"]) -> dict:
    """One step's counts: ``longest`` response, ``most_passes`` (verify passes of its slowest
    sequence), ``tokens`` and ``sequence_passes`` (verify passes + one prefill per sequence)."""
    lengths = np.array([len(r) for r in responses])
    return dict(step=step, epoch=epoch, longest=int(lengths.max()), most_passes=int(passes.max()),
                tokens=int(lengths.sum()), sequence_passes=int(passes.sum()) + len(responses))


def summarize(rows: list[dict]) -> dict:
    """``batch_ratio`` and ``per_sequence_ratio`` (module docstring) over ``step_row`` dicts:
    forward passes as the engine counts them (+ 1 prefill; plain decode needs longest - 1 decode
    passes)."""
    return dict(steps=len(rows),
                batch_ratio=sum(r["longest"] for r in rows) / sum(r["most_passes"] + 1 for r in rows),
                per_sequence_ratio=sum(r["tokens"] for r in rows) / sum(r["sequence_passes"] for r in rows))
