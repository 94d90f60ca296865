"""Plain decode beside HistoSpec on the same inputs: a ``wrap_generate`` hook for a GRPO run.

Used by the A4 ablation (``e2e.run_paired``) and ``benchmarks/rollout.py`` (issue 4): every
engine call of the run's rollout workers first generates the same prompts with the same weights
and key by plain decoding (output discarded), then with the HistoSpec drafter; the HistoSpec
rollout is what the trainer trains on. Lossless verification makes the two rollouts samples of
the same distribution, so their tokens/s and forward passes compare the decoding alone.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from rhyme_jax.rollout.shapes import MAX_DRAFT


class AlwaysRightDrafter:
    """A ``rollout.types.Drafter`` that drafts the tokens a rollout will emit, known beforehand
    (``responses``: the plain rollout of the same prompts, weights and key; with the per-position
    draws the drafted rollout emits those, unless a near tie rounds the other way in another step
    program). Every draft token is accepted and its estimate
    is 1, so the engine's goodput allocation sizes each step under its step-cost model alone: the
    rollout's speed bounds any drafter's through this engine on this machine (live, prefill
    included). ``context_width`` covers a whole sequence, so a row's tail tells how many tokens it
    has generated."""

    def __init__(self, prompts, responses, max_new_tokens: int):
        self.prompt_lens = np.array([len(p) for p in prompts], np.int64)
        self.responses = [np.asarray(r, np.int32) for r in responses]
        self.context_width = int(self.prompt_lens.max(initial=1)) + int(max_new_tokens)
        self.estimates: np.ndarray | None = None
        self.priorities = None

    def made(self, reqs: np.ndarray, tails) -> np.ndarray:
        """``int64[n]`` tokens each row of ``reqs`` has generated (from its whole-sequence tail)."""
        return np.maximum((np.asarray(tails) >= 0).sum(axis=1) - self.prompt_lens[reqs], 0)

    def draft(self, reqs, tails, budgets):
        """The next ``min(budget, MAX_DRAFT)`` tokens of each row's known response."""
        reqs = np.asarray(reqs, np.int64)
        made = self.made(reqs, tails)
        lens = np.zeros(reqs.size, np.int32)
        out = np.zeros((reqs.size, MAX_DRAFT), np.int32)
        for i, (r, n, b) in enumerate(zip(reqs, made, np.asarray(budgets))):
            d = self.responses[r][int(n): int(n) + min(int(b), MAX_DRAFT)]
            out[i, : d.size], lens[i] = d, d.size
        self.estimates = (np.arange(MAX_DRAFT)[None, :] < lens[:, None]).astype(np.float32)
        return out, lens

    def observe(self, reqs, draft_lens, accepted) -> None:
        """Nothing to learn."""


def held_run(sources: list[np.ndarray], ctx: np.ndarray, rest: np.ndarray) -> int:
    """How many leading tokens of ``rest`` follow some occurrence of ``ctx``'s last token in a
    source or earlier in ``ctx`` (self-lookup). Every suffix match of any length ends at such an
    occurrence, so this is the longest draft any suffix drafter with a minimum match of 1 token
    could find there: the best source in hindsight. (``ctx``'s own last position is searched too;
    a pad follows it, so it adds nothing.)"""
    if ctx.size == 0 or rest.size == 0:
        return 0
    k = rest.size
    pad = np.full(k, -2, np.int64)
    parts = [x for src in sources for x in (np.asarray(src, np.int64), pad)] + [np.asarray(ctx, np.int64), pad]
    hay = np.concatenate(parts)
    at = np.flatnonzero(hay[:-k] == ctx[-1])
    if at.size == 0:
        return 0
    same = hay[at[:, None] + 1 + np.arange(k)] == np.asarray(rest, np.int64)[None, :]
    return int(np.cumprod(same, axis=1).sum(axis=1).max())


class SourceBoundDrafter(AlwaysRightDrafter):
    """``AlwaysRightDrafter`` cut to what the draft sources hold: each row drafts the longest run
    of its next known tokens that follows an occurrence of its last token (``held_run``) in the
    prompt's earlier responses (``history[r]``: every earlier rollout of the prompt, prompt
    included), in the responses of the same prompt in this call so far (siblings, up to what
    they have emitted) or in the row's own context. Estimates 1, so the engine's allocation sizes
    each step: the rollout's speed bounds any drafter over these sources through this engine."""

    def __init__(self, prompts, responses, max_new_tokens: int, history: list[list[np.ndarray]]):
        super().__init__(prompts, responses, max_new_tokens)
        self.prompts = [np.asarray(p, np.int64) for p in prompts]
        self.history = [[np.concatenate([self.prompts[r], h]) for h in hs] for r, hs in enumerate(history)]
        keys = [p.tobytes() for p in self.prompts]
        self.siblings = [[j for j in range(len(keys)) if j != r and keys[j] == keys[r]] for r in range(len(keys))]
        self.done = np.zeros(len(keys), np.int64)

    def draft(self, reqs, tails, budgets):
        """``AlwaysRightDrafter.draft`` with each length cut by ``held_run`` over the sources."""
        reqs = np.asarray(reqs, np.int64)
        out, lens = super().draft(reqs, tails, budgets)
        made = self.made(reqs, tails)
        self.done[reqs] = made
        for i, (r, n) in enumerate(zip(reqs, made)):
            resp = self.responses[r]
            sibs = [np.concatenate([self.prompts[j], self.responses[j][: self.done[j]]]) for j in self.siblings[r]]
            ctx = np.concatenate([self.prompts[r], resp[:n]])
            lens[i] = held_run(self.history[r] + sibs, ctx, out[i, : lens[i]])
        self.estimates = (np.arange(MAX_DRAFT)[None, :] < lens[:, None]).astype(np.float32)
        return out, lens

    def observe(self, reqs, draft_lens, accepted) -> None:
        """Siblings see each row's tokens as soon as they are emitted."""
        self.done[np.asarray(reqs, np.int64)] += np.asarray(accepted, np.int64) + 1


class SourceBound:
    """Makes a ``SourceBoundDrafter`` per rollout and remembers every rollout's responses per
    prompt as the history of the next one."""

    def __init__(self):
        self.seen: dict[bytes, list[np.ndarray]] = {}

    def __call__(self, prompts, responses, max_new_tokens: int) -> SourceBoundDrafter:
        keys = [np.asarray(p, np.int64).tobytes() for p in prompts]
        drafter = SourceBoundDrafter(prompts, responses, max_new_tokens, [list(self.seen.get(k, ())) for k in keys])
        for k, resp in zip(keys, responses):
            self.seen.setdefault(k, []).append(np.asarray(resp, np.int64))
        return drafter


ORACLES = ("always-right", "sources")


def paired_rollouts(rows: list, oracle: str = "") -> Callable:
    """The ``wrap_generate`` hook (``GRPOTrainer(wrap_generate=...)``): each call appends
    ``{"plain": stats, "spec": stats}`` to ``rows``, where ``stats`` is the engine's
    ``RolloutResult.stats`` plus ``"compiles"`` (XLA compilations or cache loads inside that
    call; a compile inside a timed rollout would skew its tokens/s). With ``oracle`` the second
    rollout drafts over the plain rollout's tokens instead of with the run's drafter (the run's
    history is still written from it): ``"always-right"`` (``AlwaysRightDrafter``, the bound of
    any drafter) or ``"sources"`` (``SourceBoundDrafter``, the bound of any drafter over the
    history, sibling and self sources).

    Raises:
      ValueError: ``oracle`` is not ``""`` or one of ``ORACLES``.
    """
    from rhyme_jax.compile_count import CompileCounter

    if oracle and oracle not in ORACLES:
        raise ValueError(f"oracle: {oracle!r} is not one of {ORACLES}")
    make = SourceBound() if oracle == "sources" else AlwaysRightDrafter

    def wrap(generate):
        def paired_generate(state, prompts, sampling, key, drafter=None, **kw):  # kw: the scheduler's hooks
            with CompileCounter() as plain_compiles:
                plain = generate(state, prompts, sampling, key, **kw)
            if oracle:
                drafter = make(prompts, plain.tokens, sampling.max_new_tokens)
            with CompileCounter() as spec_compiles:
                spec = generate(state, prompts, sampling, key, drafter=drafter, **kw)
            rows.append({"plain": {**plain.stats, "compiles": plain_compiles.count},
                         "spec": {**spec.stats, "compiles": spec_compiles.count}})
            return spec

        return paired_generate

    return wrap
