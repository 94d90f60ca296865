"""The rollout side of a GRPO step: prompts, scheduled rollout, carried groups, in one of three orders.

One interface, ``RolloutPipeline``, three strategies chosen in one place (``make_pipeline``, from
``sched.pipeline`` and ``sched.cross_step``): ``SyncPipeline``, ``OneStepOffPipeline``,
``CrossStepPipeline``. The trainer drives every one through the same events per step:
``take`` (the step's ``StepBatch``), ``after_write_back`` (its rollouts and history are written),
``after_update`` (its update is done); ``pending_carry`` is what a checkpoint keeps.

``sched.pipeline=sync``: step s's rollout runs when step s starts, with the current params.
``one_step_off``: right after step s's write-back the rollout of step s + 1 starts in a background
thread with the params before step s's update (a copy: the update donates the live buffers), so it
overlaps the update; rollout s >= 2 then uses the params after s - 2 updates (staleness 1, logged
as ``rollout/weights_step`` and ``rollout/staleness``). With HistoPipe migration on, tails of a
one_step_off rollout are deferred to the next step instead of migrated; their groups are carried
(``sched/carry.py``) and trained one step later. docs/architecture.md, "HistoPipe".

``one_step_off`` with ``sched.cross_step=true``: the same weights (rollout s + 2 is queued right
after update s, with those params), but no barrier between rollouts: each worker runs its part
of every step from its own queue (``sched.workers.WorkerQueues``), so a worker that finishes its
part of step s goes on to step s + 1 while the others still run step s. The plan and drafts of
step s + 1 then use the history written back up to step s - 1, and deferred tails of step s are
continued by rollout s + 2 (trained two steps later).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import jax
import numpy as np

from rhyme_jax.rollout.types import SamplingParams
from rhyme_jax.sched import carry
from rhyme_jax.sched.scheduler import RolloutScheduler
from rhyme_jax.sched.step_group import StepGroup
from rhyme_jax.train.step_batch import StepBatch

if TYPE_CHECKING:
    from rhyme_jax.config import RunConfig

REFILL_KEY = 0x5EED  # folded into a step's sampling key for its refill rounds (> any worker index)


class RolloutPipeline(ABC):
    """Produces each step's ``StepBatch`` (module docstring); the shared part of the strategies:
    plan, submit and collect one rollout (``run``) and the groups carried to the next.

    Args:
      cfg: the run config (``grpo``, ``rollout``, ``run.seed``, ``sched``).
      scheduler: the rollout workers (``RolloutScheduler``).
      schedule: ``step -> int[P]`` prompt indices of the step.
      prompt_tokens: ``prompt index -> token ids``.
      rollout_states: ``params -> per-worker params`` (the weight sync).
      history, drafter: HistoSpec store and drafter (or None).
      submit: what starts a step's rollout (default ``scheduler.submit``; a callback's
        ``wrap_submit``).

    Attributes:
      carry: groups waiting for the next rollout submitted (checkpointed; set on resume).
    """

    def __init__(self, cfg: RunConfig, scheduler: RolloutScheduler, schedule: Callable[[int], np.ndarray],
                 prompt_tokens: Callable[[int], Sequence[int]], rollout_states: Callable[[Any], list],
                 history=None, drafter=None, submit: Callable[..., Any] | None = None):
        self.cfg, self.scheduler = cfg, scheduler
        self.submit = scheduler.submit if submit is None else submit
        self.schedule, self.prompt_tokens, self.rollout_states = schedule, prompt_tokens, rollout_states
        self.history, self.drafter = history, drafter
        self.carry: list[StepGroup] = []

    # ------------------------------------------------------------------ the events, per step
    @abstractmethod
    def take(self, step: int, state: Any) -> tuple[StepBatch, float]:
        """Step ``step``'s batch (rolled out now with ``state``, the params after ``step - 1``
        updates, or earlier by the strategy). Returns it and the seconds spent waiting."""

    def after_write_back(self, step: int, state: Any) -> None:
        """Step ``step``'s rollouts and history are written; ``state``: the params before its
        update. Default: nothing."""

    def after_update(self, step: int, state: Any, update_s: tuple[float, float] | None = None) -> None:
        """Step ``step``'s update is done; ``state``: the params after it; ``update_s``: the
        update's ``(start, end)`` ``perf_counter`` times. Default: nothing."""

    # ------------------------------------------------------------------ shared
    def pending_carry(self) -> list[StepGroup]:
        """Carried groups not yet trained (what a checkpoint keeps; after a resume the first
        rollout continues all of them)."""
        return list(self.carry)

    def defers(self, step: int) -> bool:
        """Whether step ``step``'s rollout stops tails for a later rollout (HistoPipe migration
        deferral) instead of migrating them. Default: never."""
        return False

    def run(self, step: int, state: Any, weights_step: int, carried: Sequence[StepGroup]) -> StepBatch:
        """Roll out step ``step`` now with ``state`` (params after ``weights_step`` updates),
        continuing the deferred samples of ``carried``."""
        return self._finish(self._start(step, state, weights_step, carried))

    def refill(self, step: int, state: Any, idx: np.ndarray, round_: int) -> StepBatch:
        """Refill round ``round_`` >= 1 of step ``step`` (``grpo.dynamic_sampling``,
        ``train/dynamic_sampling.py``): ``int[P']`` prompts ``idx`` rolled out now with ``state``
        (the params after ``step - 1`` updates), its own sampling key, nothing carried or deferred."""
        return self._finish(self._start(step, state, step - 1, [], idx=idx, round_=round_))

    def _start(self, step: int, state: Any, weights_step: int, carried: Sequence[StepGroup],
               queued: bool = False, idx: np.ndarray | None = None, round_: int = 0) -> "_Started":
        """Plan and submit step ``step``'s rollout (``RolloutScheduler.submit``); ``idx`` and
        ``round_`` > 0: a refill round's prompts (default: the step's own, ``round_`` 0)."""
        cfg, g, r = self.cfg, self.cfg.grpo, self.cfg.rollout
        n = g.samples_per_prompt
        idx = self.schedule(step) if idx is None else np.asarray(idx, np.int64)
        prompts = [list(self.prompt_tokens(int(i))) for i in idx for _ in range(n)]
        key = jax.random.fold_in(jax.random.key(cfg.run.seed), step)
        if round_:  # a key no worker of the step's own rollout uses (they fold in their index)
            key = jax.random.fold_in(jax.random.fold_in(key, REFILL_KEY), round_)
        t0 = time.perf_counter()
        pending = self.submit(
            step, self.rollout_states(state), idx, prompts, n,
            SamplingParams.from_section(r),
            key, history=self.history, drafter=self.drafter,
            carried=carry.pending_rows(carried, len(prompts)),
            defer=self.defers(step) and not round_, queued=queued)
        return _Started(step, weights_step, list(carried), idx, prompts, t0, pending)

    def _finish(self, st: "_Started") -> StepBatch:
        """Collect a started rollout and split it into trainable and carried groups."""
        sr = self.scheduler.collect(st.pending)
        # queued: the step's own span (its window can be near 0 when its work ran in the previous one)
        seconds = sr.metrics.get("time/rollout_own_s", time.perf_counter() - st.t0)
        trainable, pending = carry.step_groups(st.step, st.idx, st.prompts, self.cfg.grpo.samples_per_prompt,
                                               st.carried, sr.rows, sr.result, sr.deferred)
        return StepBatch(st.step, st.weights_step, trainable, pending, sr, seconds)

    def wait(self) -> None:
        """Let in-flight rollouts finish (their results stay queued) before the engines are used
        for anything else (evaluation). Default: nothing is in flight between steps."""

    def close(self) -> None:
        """Wait for in-flight rollouts, then stop the scheduler's workers."""
        self.wait()
        self.scheduler.close()


class SyncPipeline(RolloutPipeline):
    """``sched.pipeline=sync``: step s's rollout runs when step s starts, with the current params
    (staleness 0). Tails are migrated, never deferred; groups carried by a resumed one_step_off
    checkpoint are continued by the first rollout."""

    def take(self, step: int, state: Any) -> tuple[StepBatch, float]:
        t0 = time.perf_counter()
        batch = self.run(step, state, step - 1, self.carry)
        self.carry = batch.carry
        return batch, time.perf_counter() - t0


class OneStepOffPipeline(RolloutPipeline):
    """``sched.pipeline=one_step_off``: ``after_write_back`` of step s starts step s + 1's rollout
    in a background thread with a copy of the params before step s's update, so it overlaps the
    update (staleness 1; after a resume the first rollout runs synchronously). Tails of a rollout
    before the last step are deferred to the next one (with HistoPipe migration on)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="one-step-off-rollout")
        self._prefetch: Optional[tuple[int, Future]] = None

    def defers(self, step: int) -> bool:
        return step < self.cfg.grpo.steps

    def take(self, step: int, state: Any) -> tuple[StepBatch, float]:
        """The prefetched batch when it is step ``step``'s, else rolled out now with ``state``."""
        t0 = time.perf_counter()
        pending, self._prefetch = self._prefetch, None
        if pending is not None and pending[0] == step:
            batch = pending[1].result()
        else:
            if pending is not None:
                pending[1].result()
            batch = self.run(step, state, step - 1, self.carry)
        self.carry = batch.carry
        return batch, time.perf_counter() - t0

    def after_write_back(self, step: int, state: Any) -> None:
        """Start step ``step + 1``'s rollout now with a copy of ``state`` (the params before step
        ``step``'s update) and the groups this step carried."""
        if step < self.cfg.grpo.steps:
            self._prefetch = (step + 1, self._executor.submit(self.run, step + 1, _snapshot(state), step - 1,
                                                              self.carry))

    def wait(self) -> None:
        if self._prefetch is not None:
            self._prefetch[1].exception()

    def close(self) -> None:
        self.wait()
        self._executor.shutdown(wait=True)
        self.scheduler.close()


class CrossStepPipeline(RolloutPipeline):
    """``sched.pipeline=one_step_off`` with ``sched.cross_step=true``: the same weights (rollout
    s + 2 is queued right after update s, with those params) but no barrier between rollouts:
    each worker runs its part of every step from its own queue (``sched.workers.WorkerQueues``).
    The plan and drafts of step s + 1 use the history written back up to step s - 1, and deferred
    tails of step s are continued by rollout s + 2 (trained two steps later)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._queued: list[_Started] = []  # submitted rollouts not yet taken, in order

    def defers(self, step: int) -> bool:
        return step < self.cfg.grpo.steps - 1  # carried groups need a later rollout

    def _queue(self, step: int, state: Any, weights_step: int, carried: Sequence[StepGroup]) -> None:
        self._queued.append(self._start(step, state, weights_step, carried, queued=True))

    def run(self, step: int, state: Any, weights_step: int, carried: Sequence[StepGroup]) -> StepBatch:
        """As ``RolloutPipeline.run``, after the queued rollouts finish (a worker's engine runs one
        batch at a time)."""
        self._wait_queued()
        return super().run(step, state, weights_step, carried)

    def take(self, step: int, state: Any) -> tuple[StepBatch, float]:
        """The queued batch of step ``step``; when the queue is out of step (the first step, a
        resume) it is drained and steps ``step`` and ``step + 1`` are queued with ``state``."""
        t0 = time.perf_counter()
        if not (self._queued and self._queued[0].step == step):
            carried = self.pending_carry()  # none are lost if the queue is out of step
            self._wait_queued()
            for st in self._queued:
                self.scheduler.collect(st.pending)
            self._queued = []
            self._queue(step, state, step - 1, carried)
            if step < self.cfg.grpo.steps:
                self._queue(step + 1, _snapshot(state), step - 1, [])
            self.carry = []
        batch = self._finish(self._queued.pop(0))
        self.carry = self.carry + batch.carry  # continued by the next rollout submitted
        return batch, time.perf_counter() - t0

    def after_update(self, step: int, state: Any, update_s: tuple[float, float] | None = None) -> None:
        """Queue step ``step + 2``'s rollout with a copy of ``state`` (the params after update
        ``step``; staleness 1) behind step ``step + 1``'s on every worker, with the groups carried
        so far; ``update_s`` is busy time of every worker's devices
        (``RolloutScheduler.record_update``)."""
        if update_s is not None:
            self.scheduler.record_update(*update_s)
        if step + 2 <= self.cfg.grpo.steps:
            self._queue(step + 2, _snapshot(state), step, self.carry)
            self.carry = []

    def pending_carry(self) -> list[StepGroup]:
        """Carried groups not yet trained: those queued rollouts continue, then those waiting for
        the next rollout."""
        return [grp for st in self._queued for grp in st.carried] + list(self.carry)

    def wait(self) -> None:
        self._wait_queued()

    def _wait_queued(self) -> None:
        for st in self._queued:
            for f in st.pending.futures:
                f.exception()


def make_pipeline(cfg: RunConfig, scheduler: RolloutScheduler, schedule: Callable[[int], np.ndarray],
                  prompt_tokens: Callable[[int], Sequence[int]], rollout_states: Callable[[Any], list],
                  history=None, drafter=None, submit: Callable[..., Any] | None = None) -> RolloutPipeline:
    """The strategy of ``sched.pipeline`` / ``sched.cross_step`` (arguments: ``RolloutPipeline``):
    ``SyncPipeline`` (sync), ``OneStepOffPipeline`` (one_step_off), ``CrossStepPipeline``
    (one_step_off with cross_step)."""
    if cfg.sched.pipeline != "one_step_off":
        kind = SyncPipeline
    else:
        kind = CrossStepPipeline if cfg.sched.cross_step else OneStepOffPipeline
    return kind(cfg, scheduler, schedule, prompt_tokens, rollout_states, history=history, drafter=drafter,
                submit=submit)


def _snapshot(state: Any) -> Any:
    """A copy of the params: the next update donates the live buffers."""
    return jax.tree.map(lambda x: x.copy(), state)


@dataclass
class _Started:
    """A submitted rollout: its step, weights version, the carried groups it continues, its
    prompts (``idx``, ``prompts``), start time and scheduler handle."""

    step: int
    weights_step: int
    carried: list
    idx: np.ndarray
    prompts: list
    t0: float
    pending: Any
