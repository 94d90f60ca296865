"""HistoPipe beside fifo on the same step: a twin placement of every rollout (suite ``learning``, L4).

Separate fifo and HistoPipe runs on a shared 2-core machine meet it at other moments: their
makespans drift by up to a quarter from run to run, as much as the effect (L4's epoch 1, where
both place alike, read 0.74x between runs). Paired, every step's rollout of the HistoPipe run is
also placed by a twin scheduler in fifo mode on the same workers, weights, prompts and key, back
to back; the twin's output is discarded (the trainer trains on the HistoPipe rollout, whose
history then ranks the next steps). Which of the two goes first alternates by step, so neither
always meets a warm or a cold machine. The ratio of the two makespans in one step compares the
placements alone, as ``paired.PairedRollouts`` compares decoders.
"""

from __future__ import annotations

import dataclasses
import time

from rhyme_jax.train.callbacks import TrainerCallback

TWIN_KEYS = ("time/rollout_makespan_s", "sched/bubble_fraction", "sched/migrated_share")


class TwinPlacement(TrainerCallback):
    """The callback (``GRPOTrainer(cfg, callbacks=[TwinPlacement(mode, rows)])``) whose
    ``wrap_submit`` has every synchronous step also placed by a twin ``RolloutScheduler`` with
    ``sched.mode = mode`` on the run's engines; ``rows[step]`` gets the twin's ``TWIN_KEYS``
    metrics, its wall seconds (``"seconds"``) and ``"first"`` (whether the twin ran before the
    run's own rollout: odd steps).

    Raises (from ``wrap_submit``, while the trainer is built):
      ValueError: ``sched.pipeline`` is not ``sync``: a twin cannot run back to back with a
        rollout that overlaps the update.
    """

    def __init__(self, mode: str, rows: dict[int, dict]):
        self.mode, self.rows = mode, rows

    def wrap_submit(self, submit, scheduler):
        """``submit`` (the run's own ``RolloutScheduler.submit``) with the twin placed before it on
        odd steps and after it on even ones."""
        from rhyme_jax.sched.scheduler import RolloutScheduler

        sched, rows = scheduler.cfg, self.rows
        if sched.pipeline != "sync":
            raise ValueError(f"TwinPlacement: sched.pipeline={sched.pipeline!r}: a twin placement needs "
                             "synchronous rollouts (sched.pipeline=sync)")
        twin = RolloutScheduler(scheduler.engines, dataclasses.replace(sched, mode=self.mode),
                                scheduler.max_new_tokens)

        def run_twin(step, args, kw) -> None:
            t0 = time.perf_counter()
            sr = twin.collect(twin.submit(step, *args, **{**kw, "queued": False}))
            rows[step] = {**{k: float(sr.metrics.get(k, 0.0)) for k in TWIN_KEYS},
                          "seconds": time.perf_counter() - t0, "first": step % 2 == 1}

        def paired_submit(step, *args, **kw):
            if step % 2 == 1:
                run_twin(step, args, kw)
                return submit(step, *args, **kw)
            pending = submit(step, *args, **kw)  # synchronous: done when it returns
            run_twin(step, args, kw)
            return pending

        return paired_submit
