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

    def draft(self, reqs, tails, budgets):
        """The next ``min(budget, MAX_DRAFT)`` tokens of each row's known response."""
        reqs = np.asarray(reqs, np.int64)
        made = (np.asarray(tails) >= 0).sum(axis=1) - self.prompt_lens[reqs]
        lens = np.zeros(reqs.size, np.int32)
        out = np.zeros((reqs.size, MAX_DRAFT), np.int32)
        for i, (r, n, b) in enumerate(zip(reqs, made, np.asarray(budgets))):
            d = self.responses[r][max(int(n), 0): max(int(n), 0) + min(int(b), MAX_DRAFT)]
            out[i, : d.size], lens[i] = d, d.size
        self.estimates = (np.arange(MAX_DRAFT)[None, :] < lens[:, None]).astype(np.float32)
        return out, lens

    def observe(self, reqs, draft_lens, accepted) -> None:
        """Nothing to learn."""


def paired_rollouts(rows: list, oracle: bool = False) -> Callable:
    """The ``wrap_generate`` hook (``GRPOTrainer(wrap_generate=...)``): each call appends
    ``{"plain": stats, "spec": stats}`` to ``rows``, where ``stats`` is the engine's
    ``RolloutResult.stats`` plus ``"compiles"`` (XLA compilations or cache loads inside that
    call; a compile inside a timed rollout would skew its tokens/s). With ``oracle`` the second
    rollout drafts with ``AlwaysRightDrafter`` over the plain rollout's tokens instead of the
    run's drafter (the bound of any drafter; the run's history is still written from it)."""
    from rhyme_jax.compile_count import CompileCounter

    def wrap(generate):
        def paired_generate(state, prompts, sampling, key, drafter=None, **kw):  # kw: the scheduler's hooks
            with CompileCounter() as plain_compiles:
                plain = generate(state, prompts, sampling, key, **kw)
            if oracle:
                drafter = AlwaysRightDrafter(prompts, plain.tokens, sampling.max_new_tokens)
            with CompileCounter() as spec_compiles:
                spec = generate(state, prompts, sampling, key, drafter=drafter, **kw)
            rows.append({"plain": {**plain.stats, "compiles": plain_compiles.count},
                         "spec": {**spec.stats, "compiles": spec_compiles.count}})
            return spec

        return paired_generate

    return wrap
