"""Which train prompts a GRPO step uses, and their token ids.

The prompts of step s are a pure function of ``(run.seed, s)`` (consecutive slices of per-epoch
permutations of the GRPO prompt set), so a run resumed from step k replays steps k+1.. exactly as
an uninterrupted run would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
from jaxtyping import Int

from rhyme_jax.data import Problem
from rhyme_jax.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from rhyme_jax.config import RunConfig


def num_grpo_prompts(cfg: RunConfig, num_train: int) -> int:
    """Size of the prompt set GRPO cycles over: ``grpo.num_prompts`` (0 = all train problems)."""
    return min(num_train, cfg.grpo.num_prompts or num_train)


def epoch_of_step(cfg: RunConfig, num_train: int, step: int) -> int:
    """1-based epoch (pass over the GRPO prompt set) in which step ``step`` starts."""
    return (step - 1) * int(cfg.grpo.prompts_per_step) // num_grpo_prompts(cfg, num_train) + 1


def prompt_schedule(seed: int, num_problems: int, step: int, per_step: int) -> Int[np.ndarray, "P"]:
    """``int64[per_step]`` indices of the train problems used at GRPO ``step`` (1-based):
    consecutive slices of per-epoch permutations seeded by (seed, epoch). Pure function of its
    arguments."""
    start = (step - 1) * per_step
    out = []
    while len(out) < per_step:
        epoch, offset = divmod(start + len(out), num_problems)
        perm = np.random.default_rng([seed, epoch]).permutation(num_problems)
        take = min(per_step - len(out), num_problems - offset)
        out.extend(perm[offset:offset + take].tolist())
    return np.asarray(out, dtype=np.int64)


class PromptTokens:
    """Token ids of train prompts (``model.prompt_template`` applied to the question), each
    encoded once: ``prompt_tokens(idx) -> list[int]``.

    Args:
      tokenizer: the run's tokenizer.
      problems: the train problems (indexed by prompt index).
      template: ``model.prompt_template``.
    """

    def __init__(self, tokenizer: Tokenizer, problems: Sequence[Problem], template: str):
        self.tokenizer, self.problems, self.template = tokenizer, problems, template
        self._cache: dict[int, list[int]] = {}

    def __call__(self, idx: int) -> list[int]:
        idx = int(idx)
        if idx not in self._cache:
            text = self.tokenizer.format_prompt(self.template, self.problems[idx].question)
            self._cache[idx] = self.tokenizer.encode(text)
        return self._cache[idx]
