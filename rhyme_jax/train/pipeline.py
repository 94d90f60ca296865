"""The rollout side of a GRPO step: prompts, scheduled rollout, carried groups, one_step_off prefetch.

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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import jax
import numpy as np

from rhyme_jax.rollout.types import SamplingParams
from rhyme_jax.sched import carry
from rhyme_jax.sched.scheduler import RolloutScheduler, StepRollout

if TYPE_CHECKING:
    from rhyme_jax.config import RunConfig


@dataclass
class StepBatch:
    """A finished rollout ready for training.

    Attributes:
      step: the GRPO step it is for; ``weights_step``: updates applied to the params it used.
      groups: complete groups to train now (carried groups of earlier steps first).
      carry: groups of this step with deferred samples (continued by the next rollout submitted:
        step + 1, or step + 2 with cross-step queues).
      rollout: the scheduler's output (metrics, intervals, plan, stats).
      seconds: the rollout's own duration.
    """

    step: int
    weights_step: int
    groups: list[carry.Group]
    carry: list[carry.Group]
    rollout: StepRollout
    seconds: float

    # The trained rows, group after group (each group's samples consecutive): N = groups x n.
    @cached_property
    def ids(self) -> np.ndarray:
        """``int64[N]`` prompt index (into the train problems) of each row."""
        return np.array([grp.prompt_idx for grp in self.groups for _ in grp.tokens], np.int64)

    @cached_property
    def prompts(self) -> list[list[int]]:
        """Each row's prompt token ids."""
        return [grp.prompt.tolist() for grp in self.groups for _ in grp.tokens]

    @cached_property
    def tokens(self) -> list[np.ndarray]:
        """Each row's response ``int32[m]``."""
        return [t for grp in self.groups for t in grp.tokens]

    @cached_property
    def logprobs(self) -> list[np.ndarray]:
        """Each row's behaviour logprobs ``float32[m]`` (one per response token)."""
        return [lp for grp in self.groups for lp in grp.logprobs]

    @cached_property
    def skipped(self) -> np.ndarray:
        """``bool[N]``: rows of prompts over ``rollout.max_prompt_len`` (``on_overlong_prompt=skip``:
        empty response, reward 0, no loss)."""
        return np.array([f == "skipped" for grp in self.groups for f in grp.finish], bool)


class RolloutPipeline:
    """Produces each step's ``StepBatch`` in sync or one_step_off order.

    Args:
      cfg: the run config (``grpo``, ``rollout``, ``run.seed``, ``sched``).
      scheduler: the rollout workers (``RolloutScheduler``).
      schedule: ``step -> int[P]`` prompt indices of the step.
      prompt_tokens: ``prompt index -> token ids``.
      rollout_states: ``params -> per-worker params`` (the weight sync).
      history, drafter: HistoSpec store and drafter (or None).
    """

    def __init__(self, cfg: RunConfig, scheduler: RolloutScheduler, schedule: Callable[[int], np.ndarray],
                 prompt_tokens: Callable[[int], Sequence[int]], rollout_states: Callable[[Any], list],
                 history=None, drafter=None):
        self.cfg, self.scheduler = cfg, scheduler
        self.schedule, self.prompt_tokens, self.rollout_states = schedule, prompt_tokens, rollout_states
        self.history, self.drafter = history, drafter
        self.carry: list[carry.Group] = []  # groups waiting for the next rollout (checkpointed)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="one-step-off-rollout")
        self._prefetch: Optional[tuple[int, Future]] = None
        self._queued: list[_Started] = []  # cross-step: submitted rollouts not yet taken, in order

    @property
    def one_step_off(self) -> bool:
        return self.cfg.sched.pipeline == "one_step_off"

    @property
    def cross_step(self) -> bool:
        """one_step_off with cross-step worker queues (``sched.cross_step``)."""
        return self.one_step_off and bool(self.cfg.sched.cross_step)

    def _start(self, step: int, state: Any, weights_step: int, carried: Sequence[carry.Group],
               queued: bool = False) -> "_Started":
        """Plan and submit step ``step``'s rollout (``RolloutScheduler.submit``)."""
        cfg, g, r = self.cfg, self.cfg.grpo, self.cfg.rollout
        n = g.samples_per_prompt
        idx = self.schedule(step)
        prompts = [list(self.prompt_tokens(int(i))) for i in idx for _ in range(n)]
        key = jax.random.fold_in(jax.random.key(cfg.run.seed), step)
        last_defer = g.steps - (1 if self.cross_step else 0)  # carried groups need a later rollout
        t0 = time.perf_counter()
        pending = self.scheduler.submit(
            step, self.rollout_states(state), idx, prompts, n,
            SamplingParams.from_section(r),
            key, history=self.history, drafter=self.drafter,
            carried=carry.pending_rows(carried, len(prompts)),
            defer=self.one_step_off and step < last_defer, queued=queued)
        started = _Started(step, weights_step, list(carried), idx, prompts, t0, pending)
        if queued:
            self._queued.append(started)
        return started

    def _finish(self, st: "_Started") -> StepBatch:
        """Collect a started rollout and split it into trainable and carried groups."""
        sr = self.scheduler.collect(st.pending)
        # queued: the step's own span (its window can be near 0 when its work ran in the previous one)
        seconds = sr.metrics.get("time/rollout_own_s", time.perf_counter() - st.t0)
        trainable, pending = carry.step_groups(st.step, st.idx, st.prompts, self.cfg.grpo.samples_per_prompt,
                                               st.carried, sr.rows, sr.result, sr.deferred)
        return StepBatch(st.step, st.weights_step, trainable, pending, sr, seconds)

    def run(self, step: int, state: Any, weights_step: int, carried: Sequence[carry.Group]) -> StepBatch:
        """Roll out step ``step`` with ``state`` (params after ``weights_step`` updates),
        continuing the deferred samples of ``carried``. With cross-step queues, queued rollouts
        finish first (a worker's engine runs one batch at a time)."""
        self._wait_queued()
        return self._finish(self._start(step, state, weights_step, carried))

    def take(self, step: int, state: Any) -> tuple[StepBatch, float]:
        """Step ``step``'s batch: the prefetched (or queued) one under one_step_off, else rolled
        out now with ``state`` (after ``step - 1`` updates). Returns it and the seconds spent
        waiting."""
        t0 = time.perf_counter()
        if self.cross_step:
            if not (self._queued and self._queued[0].step == step):
                carried = self.pending_carry()  # none are lost if the queue is out of step
                self._wait_queued()
                for st in self._queued:
                    self.scheduler.collect(st.pending)
                self._queued = []
                self._start(step, state, step - 1, carried, queued=True)
                if step < self.cfg.grpo.steps:
                    self._start(step + 1, _snapshot(state), step - 1, [], queued=True)
                self.carry = []
            batch = self._finish(self._queued.pop(0))
            self.carry = self.carry + batch.carry  # continued by the next rollout submitted
            return batch, time.perf_counter() - t0
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
        """one_step_off: start step ``step + 1``'s rollout now with a copy of ``state`` (the params
        before step ``step``'s update) and the groups this step carried. (With cross-step queues
        that rollout is already queued: see ``after_update``.)"""
        if self.one_step_off and not self.cross_step and step < self.cfg.grpo.steps:
            self._prefetch = (step + 1, self._executor.submit(self.run, step + 1, _snapshot(state), step - 1,
                                                              self.carry))

    def after_update(self, step: int, state: Any, update_s: tuple[float, float] | None = None) -> None:
        """Cross-step queues: queue step ``step + 2``'s rollout with a copy of ``state`` (the params
        after update ``step``; staleness 1) behind step ``step + 1``'s on every worker, with the
        groups carried so far. ``update_s``: the update's ``(start, end)`` ``perf_counter`` times,
        busy time of every worker's devices (``RolloutScheduler.record_update``)."""
        if self.cross_step and update_s is not None:
            self.scheduler.record_update(*update_s)
        if self.cross_step and step + 2 <= self.cfg.grpo.steps:
            self._start(step + 2, _snapshot(state), step, self.carry, queued=True)
            self.carry = []

    def pending_carry(self) -> list[carry.Group]:
        """Carried groups not yet trained: those queued rollouts continue, then those waiting for
        the next rollout (what a checkpoint keeps; after a resume the first rollout continues
        all of them)."""
        return [grp for st in self._queued for grp in st.carried] + list(self.carry)

    def wait(self) -> None:
        """Let in-flight rollouts finish (their results stay queued) before the engines are used
        for anything else (evaluation)."""
        if self._prefetch is not None:
            self._prefetch[1].exception()
        self._wait_queued()

    def _wait_queued(self) -> None:
        for st in self._queued:
            for f in st.pending.futures:
                f.exception()

    def close(self) -> None:
        self.wait()
        self._executor.shutdown(wait=True)
        self.scheduler.close()


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
