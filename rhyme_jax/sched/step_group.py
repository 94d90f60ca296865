"""One GRPO group of a step, the one form a step's samples take from the scheduler to the loss.

A ``StepGroup`` is one prompt's ``n`` samples: made from a scheduled rollout
(``carry.split_step``), carried to a later rollout while some samples are deferred
(``carry.complete`` fills them), trained as part of the step's ``train.step_batch.StepBatch``,
and scored there (``rewards``); advantages are computed per group (``StepBatch.group_rewards``).
docs/architecture.md, "Data flow of one GRPO step".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass
class StepGroup:
    """One GRPO group of a step.

    Attributes:
      prompt_idx: index of its prompt among the train problems.
      prompt: ``int32[p]`` prompt token ids.
      tokens: per sample its response ``int32[m_i]`` (partial while ``pending[i]``).
      logprobs: per sample the behaviour logprobs ``float32[m_i]`` of ``tokens[i]``.
      finish: per sample its finish reason (``"eos"``, ``"length"``, ``"skipped"``; ``"deferred"``
        while pending).
      pending: ``bool[n]``, True for a deferred sample whose response a later rollout continues.
      origin: the GRPO step that scheduled the group.
      rewards: ``float32[n]`` once the trainer has scored the group, else None (never saved with
        carried groups: those are not scored yet).
    """

    prompt_idx: int
    prompt: np.ndarray
    tokens: list[np.ndarray]
    logprobs: list[np.ndarray]
    finish: list[str]
    pending: np.ndarray
    origin: int
    rewards: Optional[np.ndarray] = None

    @property
    def complete(self) -> bool:
        """Whether every sample's response is finished (the group can be trained)."""
        return not bool(self.pending.any())
