"""The rollout side of a GRPO step: prompts, scheduled rollout, carried groups, one_step_off prefetch.

``sched.pipeline=sync``: step s's rollout runs when step s starts, with the current params.
``one_step_off``: right after step s's write-back the rollout of step s + 1 starts in a background
thread with the params before step s's update (a copy: the update donates the live buffers), so it
overlaps the update; rollout s >= 2 then uses the params after s - 2 updates (staleness 1, logged
as ``rollout/weights_step`` and ``rollout/staleness``). With HistoPipe migration on, tails of a
one_step_off rollout are deferred to the next step instead of migrated; their groups are carried
(``sched/carry.py``) and trained one step later. ARCHITECTURE.md section 6.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np

from rhyme_jax.rollout.types import RolloutResult, SamplingParams
from rhyme_jax.sched import carry
from rhyme_jax.sched.scheduler import RolloutScheduler, StepRollout


@dataclass
class StepBatch:
    """A finished rollout ready for training.

    Attributes:
      step: the GRPO step it is for; ``weights_step``: updates applied to the params it used.
      groups: complete groups to train now (carried groups of earlier steps first).
      carry: groups of this step with deferred samples (continued by the next rollout).
      rollout: the scheduler's output (metrics, intervals, plan, stats).
      seconds: the rollout's own duration.
    """

    step: int
    weights_step: int
    groups: list[carry.Group]
    carry: list[carry.Group]
    rollout: StepRollout
    seconds: float


def _subset(result: RolloutResult, pos: np.ndarray) -> RolloutResult:
    return RolloutResult([result.tokens[i] for i in pos], [result.logprobs[i] for i in pos],
                         [result.finish_reasons[i] for i in pos], result.stats)


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

    def __init__(self, cfg: Any, scheduler: RolloutScheduler, schedule: Callable[[int], np.ndarray],
                 prompt_tokens: Callable[[int], Sequence[int]], rollout_states: Callable[[Any], list],
                 history=None, drafter=None):
        self.cfg, self.scheduler = cfg, scheduler
        self.schedule, self.prompt_tokens, self.rollout_states = schedule, prompt_tokens, rollout_states
        self.history, self.drafter = history, drafter
        self.carry: list[carry.Group] = []  # groups waiting for the next rollout (checkpointed)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="one-step-off-rollout")
        self._prefetch: Optional[tuple[int, Future]] = None

    @property
    def one_step_off(self) -> bool:
        return self.cfg.sched.pipeline == "one_step_off"

    def run(self, step: int, state: Any, weights_step: int, carried: Sequence[carry.Group]) -> StepBatch:
        """Roll out step ``step`` with ``state`` (params after ``weights_step`` updates),
        continuing the deferred samples of ``carried``."""
        cfg, g, r = self.cfg, self.cfg.grpo, self.cfg.rollout
        n = g.samples_per_prompt
        idx = self.schedule(step)
        prompts = [list(self.prompt_tokens(int(i))) for i in idx for _ in range(n)]
        key = jax.random.fold_in(jax.random.key(cfg.run.seed), step)
        ex = carry.extras(carried)
        t0 = time.perf_counter()
        sr = self.scheduler.rollout(
            step, self.rollout_states(state), idx, prompts, n,
            SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, max_new_tokens=r.max_new_tokens),
            key, history=self.history, drafter=self.drafter,
            extra=[(carried[gi].prompt_idx, prompt, tok, lps) for gi, _, prompt, tok, lps in ex],
            defer=self.one_step_off and step < g.steps)
        seconds = time.perf_counter() - t0
        own = sr.rows < len(prompts)
        groups = carry.split_step(step, idx, prompts, n, sr.rows[own], _subset(sr.result, np.flatnonzero(own)),
                                  sr.deferred)
        done = carry.complete(carried, [(gi, i) for gi, i, *_ in ex], sr.result, np.flatnonzero(~own))
        return StepBatch(step, weights_step, done + [grp for grp in groups if grp.complete],
                         [grp for grp in groups if not grp.complete], sr, seconds)

    def take(self, step: int, state: Any) -> tuple[StepBatch, float]:
        """Step ``step``'s batch: the prefetched one under one_step_off, else rolled out now with
        ``state`` (after ``step - 1`` updates). Returns it and the seconds spent waiting."""
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
        """one_step_off: start step ``step + 1``'s rollout now with a copy of ``state`` (the params
        before step ``step``'s update) and the groups this step carried."""
        if self.one_step_off and step < self.cfg.grpo.steps:
            snapshot = jax.tree.map(lambda x: x.copy(), state)
            self._prefetch = (step + 1, self._executor.submit(self.run, step + 1, snapshot, step - 1, self.carry))

    def wait(self) -> None:
        """Let an in-flight prefetch finish (its result stays queued) before the engines are
        used for anything else (evaluation)."""
        if self._prefetch is not None:
            self._prefetch[1].exception()

    def close(self) -> None:
        self.wait()
        self._executor.shutdown(wait=True)
