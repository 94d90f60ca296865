"""A GRPO step's data from its finished rollout to the loss: ``StepBatch``.

The rollout pipeline (``train/pipeline.py``) makes it from a scheduled rollout
(``sched.scheduler.StepRollout``): the step's complete groups (``sched.step_group.StepGroup``,
carried groups of earlier steps first) and the groups it carries on. The trainer scores it
(``set_rewards``), writes it back, trains on it and logs it; its rows (``ids``, ``prompts``,
``tokens``, ``logprobs``, ``skipped``, ``rewards``) are views of the groups, group after group,
each group's samples consecutive (N = groups x n rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from rhyme_jax.sched.scheduler import StepRollout
from rhyme_jax.sched.step_group import StepGroup


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
    groups: list[StepGroup]
    carry: list[StepGroup]
    rollout: StepRollout
    seconds: float

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

    @cached_property
    def truncated(self) -> np.ndarray:
        """``bool[N]``: rows that hit ``rollout.max_new_tokens`` without EOS (finish ``"length"``;
        ``grpo.mask_truncated_completions`` takes their loss away)."""
        return np.array([f == "length" for grp in self.groups for f in grp.finish], bool)

    def set_rewards(self, rewards: np.ndarray) -> None:
        """Score the batch: ``rewards`` ``float32[N]`` (one per row) go to each group's
        ``rewards``.

        Raises:
          ValueError: not one reward per row.
        """
        if len(rewards) != len(self.tokens):
            raise ValueError(f"StepBatch.set_rewards: {len(rewards)} rewards for {len(self.tokens)} rows")
        at = 0
        for grp in self.groups:
            grp.rewards, at = rewards[at: at + len(grp.tokens)], at + len(grp.tokens)

    def _check_scored(self) -> None:
        if any(grp.rewards is None for grp in self.groups):
            raise ValueError(f"StepBatch of step {self.step}: not scored yet (set_rewards)")

    @property
    def rewards(self) -> np.ndarray:
        """``float32[N]`` each row's reward (``set_rewards``).

        Raises:
          ValueError: the batch is not scored yet.
        """
        self._check_scored()
        return np.concatenate([grp.rewards for grp in self.groups]) if self.groups else np.zeros(0, np.float32)

    @property
    def group_rewards(self) -> np.ndarray:
        """``float32[G, n]`` the rewards group by group (what group advantages need).

        Raises:
          ValueError: the batch is not scored yet.
        """
        self._check_scored()
        return np.stack([grp.rewards for grp in self.groups])
