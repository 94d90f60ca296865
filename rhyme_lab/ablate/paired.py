"""Plain decode beside HistoSpec on the same inputs: a ``TrainerCallback`` for a GRPO run.

Used by the A4 ablation and the learning suite's paired units (``e2e.run_paired``) and
``benchmarks.rollout`` (issue 4): every engine call of the run's rollout workers generates the
same prompts with the same weights and key by plain decoding (output discarded) and with the
HistoSpec drafter, back to back, the two taking turns going first; the HistoSpec rollout is what
the trainer trains on. Lossless verification makes the two rollouts samples of
the same distribution, so their tokens/s and forward passes compare the decoding alone. The
oracle drafters (``--oracle``) are ``measure.oracle_drafters``' (re-exported here).
"""

from __future__ import annotations

from rhyme_jax.sched.workers import GenerateFn
from rhyme_jax.train.callbacks import TrainerCallback
from rhyme_lab.measure.oracle_drafters import ORACLES, AlwaysRightDrafter, SourceBound, SourceBoundDrafter, held_run

__all__ = ["ORACLES", "AlwaysRightDrafter", "SourceBound", "SourceBoundDrafter", "held_run", "PairedRollouts"]


class PairedRollouts(TrainerCallback):
    """The callback (``GRPOTrainer(cfg, callbacks=[PairedRollouts(rows)])``) whose
    ``wrap_generate`` pairs every engine call: each call appends ``{"plain": stats, "spec":
    stats}`` to ``rows``, where ``stats`` is the engine's ``RolloutResult.stats`` plus
    ``"compiles"`` (XLA compilations or cache loads inside that call; a compile inside a timed
    rollout would skew its tokens/s). With ``oracle`` the last rollout (``"spec"``) drafts over
    the plain rollout's tokens instead of with the run's drafter (the run's history is still
    written from it): ``"always-right"`` (``AlwaysRightDrafter``, the bound of any drafter) or
    ``"sources"`` (``SourceBoundDrafter``, the bound of any drafter over the history, sibling and
    self sources; ``depth``: the prompt's latest rollouts kept as its history, ``SourceBound``);
    between the two, the run's own drafter decodes the same inputs (``"own"``), so its share of
    the bound is measured in the same steps, free of the drift between separate runs. Order: a
    call's rollouts run back to back, and the machine can favour a place in that order (caches,
    clocks; on 2 shared CPU cores one rollout's time varies by 10-20% from one place to the next:
    over 3 steps of the ledger task the run's drafter, sending no drafts, timed 1.15x plain, which
    had always gone first), so the compared rollouts take turns: without an oracle, plain goes
    first on even calls and HistoSpec on odd ones; with one, a plain rollout whose tokens the
    oracle drafts runs first (``"first"``, not compared), then plain, the run's own drafter and
    the oracle, rotating which of them goes first. The call's weights (the update's output
    cast to the compute dtype and copied to the worker, dispatched asynchronously) are waited for
    before the first clock starts, so neither place pays for them.

    Raises:
      ValueError: ``oracle`` is not ``""`` or one of ``ORACLES``.
    """

    def __init__(self, rows: list, oracle: str = "", depth: int | None = None):
        if oracle and oracle not in ORACLES:
            raise ValueError(f"oracle: {oracle!r} is not one of {ORACLES}")
        self.rows, self.oracle = rows, oracle
        self.make = SourceBound(depth) if oracle == "sources" else AlwaysRightDrafter

    def wrap_generate(self, generate: GenerateFn) -> GenerateFn:
        """``generate`` (one worker's engine call) run plain and with HistoSpec, back to back
        (class docstring); returns the HistoSpec (or oracle) rollout."""
        import jax

        from rhyme_jax.compile_count import CompileCounter

        rows, oracle, make = self.rows, self.oracle, self.make
        calls = [0]

        def paired_generate(state, prompts, sampling, key, drafter=None, **kw):  # kw: the scheduler's hooks
            row, flip = {}, calls[0] % 2 == 1
            calls[0] += 1
            jax.block_until_ready(state)  # the step's rollout weights (cast, copied) before either clock starts

            def run(name, with_drafter=None):
                with CompileCounter() as compiles:
                    out = generate(state, prompts, sampling, key, drafter=with_drafter, **kw)
                row[name] = {**out.stats, "compiles": compiles.count}
                return out

            if oracle:  # a plain rollout the oracle drafts from (not compared), then the three in turns
                bound = make(prompts, run("first").tokens, sampling.max_new_tokens)
                three = (("plain", None), ("own", drafter), ("spec", bound))
                k = (calls[0] - 1) % 3
                order = three[k:] + three[:k]
            else:  # plain and HistoSpec in turns
                order = (("spec", drafter), ("plain", None)) if flip else (("plain", None), ("spec", drafter))
            out = {name: run(name, d) for name, d in order}
            rows.append(row)
            return out["spec"]

        return paired_generate
