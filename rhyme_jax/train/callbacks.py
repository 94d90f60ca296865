"""The one seam into a GRPO run: ``TrainerCallback`` (in the spirit of TRL's ``TrainerCallback``).

Code outside the product (the lab's paired rollouts, policy-mode capture, benchmarks) and the
product's own extras (the Gantt plot) reach into a training run only through callbacks passed as
``GRPOTrainer(cfg, callbacks=[...])``. Every method defaults to a no-op; a callback overrides the
events it needs. Callbacks run in list order, on the trainer's thread (``wrap_generate``'s
wrapper runs on the rollout worker threads), after the built-in ones (``builtin_callbacks``).

Events, in the order they fire (``step`` is the 1-based GRPO step):

``wrap_generate(generate) -> generate``
    Once per local rollout worker, while the run is assembled (``assembly.build_rollout``), before
    any rollout: returns the function the worker calls instead of its engine's ``generate`` (same
    signature, ``sched.workers.GenerateFn``; it must return the rollout the run trains on). How
    the lab pairs each HistoSpec rollout with a plain one on the same inputs.
``wrap_submit(submit, scheduler) -> submit``
    Once, when the rollout pipeline is built (``assembly.build_pipeline``): returns the function
    the pipeline calls instead of ``scheduler.submit`` (``sched.scheduler.RolloutScheduler``, same
    signature and return) to start every step's rollout. How the lab places each rollout a second
    time with a twin scheduler on the same workers; it may raise (``ValueError``) to refuse a run
    it cannot wrap, before any step.
``on_rollout_end(trainer, step, batch)``
    Each step, once its rollout is collected and scored, before it is written back (rollout log,
    schedule, history store): ``batch`` is the ``step_batch.StepBatch`` (its groups, scored, and
    the flattened rows ``ids``, ``prompts``, ``tokens``, ``logprobs``, ``skipped``, ``rewards``
    ``float32[N]``).
``on_before_update(trainer, step, state, batch)``
    Right before the step's update, only when the step has groups to train: ``state`` is the
    params the update starts from (the behaviour params under ``sched.pipeline=sync``).
``on_update_end(trainer, step, state, minibatch_metrics)``
    Right after the update (same condition): ``state`` the updated params, ``minibatch_metrics``
    one dict of host floats per minibatch.
``on_step_end(trainer, step, metrics)``
    Each step, last: the step's metrics row (``dict[str, float]``, what ``metrics.jsonl`` logs).
``on_train_end(trainer)``
    Once from ``GRPOTrainer.fit``, after the last step (and its checkpoint), before the final
    held-out evaluation. Runs driving ``train_step`` themselves do not get it.

What a callback may not do: mutate ``batch`` (its groups, rows or rewards), ``metrics`` or the
trainer's state (the run must train the same tokens whether or not callbacks are attached), or
keep ``state`` past the event without copying it (the next update donates its buffers). Its time
counts in the step's wall time but never in ``time/train_s`` (the update alone); inside the
``wrap_generate`` / ``wrap_submit`` wrappers it is rollout time (``time/rollout_*``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from rhyme_jax.sched.timeline import load_schedule, plot_gantt
from rhyme_jax.sched.workers import GenerateFn

if TYPE_CHECKING:
    from rhyme_jax.train.step_batch import StepBatch

# The ``trainer`` every event receives is the ``train.trainer.GRPOTrainer`` running the callbacks
# (read its ``cfg``, ``run_dir``, ``primary``, ``policy``, ``tokenizer``, ``history``; the trainer
# module imports this one, so it is not imported here).
GRPOTrainer = Any


class TrainerCallback:
    """Base class of a GRPO run's callbacks: every event is a no-op (module docstring)."""

    def wrap_generate(self, generate: GenerateFn) -> GenerateFn:
        """The function a rollout worker calls instead of ``generate`` (default: ``generate``)."""
        return generate

    def wrap_submit(self, submit: Callable[..., Any], scheduler: Any) -> Callable[..., Any]:
        """The function the pipeline calls instead of ``scheduler.submit`` (default: ``submit``)."""
        return submit

    def on_rollout_end(self, trainer: GRPOTrainer, step: int, batch: StepBatch) -> None:
        """Step ``step``'s rollout collected and scored (``batch.rewards``)."""

    def on_before_update(self, trainer: GRPOTrainer, step: int, state: Any, batch: StepBatch) -> None:
        """Right before step ``step``'s update; ``state``: the params it starts from."""

    def on_update_end(self, trainer: GRPOTrainer, step: int, state: Any, minibatch_metrics: list[dict]) -> None:
        """Right after step ``step``'s update; ``state``: the updated params."""

    def on_step_end(self, trainer: GRPOTrainer, step: int, metrics: dict[str, float]) -> None:
        """Step ``step`` done; ``metrics``: its metrics row."""

    def on_train_end(self, trainer: GRPOTrainer) -> None:
        """``fit``'s last step done, before the final evaluation."""


class GanttPlot(TrainerCallback):
    """Built-in: ``<run>/gantt.png``, the rollout workers' busy intervals of every step
    (``timeline.plot_gantt`` over the saved schedule), drawn by the primary process at the end of
    ``fit``."""

    def on_train_end(self, trainer: GRPOTrainer) -> None:
        if trainer.primary:
            plot_gantt(load_schedule(trainer.run_dir), trainer.run_dir / "gantt.png",
                       num_workers=trainer.scheduler.local, title=f"rollout workers ({trainer.cfg.sched.mode})")


def builtin_callbacks() -> list[TrainerCallback]:
    """The product's own callbacks, always on and first: ``GanttPlot``."""
    return [GanttPlot()]


class CallbackList:
    """Callbacks in order, fired together (``fire(event, *args)`` calls ``event`` on each).

    Args:
      callbacks: ``TrainerCallback`` instances.

    Raises:
      TypeError: an entry is not a ``TrainerCallback``.
    """

    def __init__(self, callbacks: Sequence[TrainerCallback] = ()):
        bad = [c for c in callbacks if not isinstance(c, TrainerCallback)]
        if bad:
            raise TypeError(f"callbacks: {bad[0]!r} is not a rhyme_jax.train.callbacks.TrainerCallback")
        self.callbacks = list(callbacks)

    def wrap_generate(self, generate: GenerateFn) -> GenerateFn:
        """``generate`` wrapped by every callback, the first callback innermost."""
        for cb in self.callbacks:
            generate = cb.wrap_generate(generate)
        return generate

    def wrap_submit(self, submit: Callable[..., Any], scheduler: Any) -> Callable[..., Any]:
        """``submit`` wrapped by every callback, the first callback innermost."""
        for cb in self.callbacks:
            submit = cb.wrap_submit(submit, scheduler)
        return submit

    def fire(self, event: str, *args: Any) -> None:
        """Call ``event`` (an ``on_*`` method name) on every callback with ``args``."""
        for cb in self.callbacks:
            getattr(cb, event)(*args)
