"""Plain decode beside HistoSpec on the same inputs: a ``wrap_generate`` hook for a GRPO run.

Used by the A4 ablation (``e2e.run_paired``) and ``benchmarks/rollout.py`` (issue 4): every
engine call of the run's rollout workers first generates the same prompts with the same weights
and key by plain decoding (output discarded), then with the HistoSpec drafter; the HistoSpec
rollout is what the trainer trains on. Lossless verification makes the two rollouts samples of
the same distribution, so their tokens/s and forward passes compare the decoding alone.
"""

from __future__ import annotations

from typing import Callable


def paired_rollouts(rows: list) -> Callable:
    """The ``wrap_generate`` hook (``GRPOTrainer(wrap_generate=...)``): each call appends
    ``{"plain": stats, "spec": stats}`` to ``rows``, where ``stats`` is the engine's
    ``RolloutResult.stats`` plus ``"compiles"`` (XLA compilations or cache loads inside that
    call; a compile inside a timed rollout would skew its tokens/s)."""
    from rhyme_jax.compile_count import CompileCounter

    def wrap(generate):
        def paired_generate(state, prompts, sampling, key, drafter=None, **kw):  # kw: the scheduler's hooks
            with CompileCounter() as plain_compiles:
                plain = generate(state, prompts, sampling, key, **kw)
            with CompileCounter() as spec_compiles:
                spec = generate(state, prompts, sampling, key, drafter=drafter, **kw)
            rows.append({"plain": {**plain.stats, "compiles": plain_compiles.count},
                         "spec": {**spec.stats, "compiles": spec_compiles.count}})
            return spec

        return paired_generate

    return wrap
