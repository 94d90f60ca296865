"""Held-out evaluation: greedy rollouts through the paged engine, scored by the task reward."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import numpy as np

from rhyme_jax.data import Problem
from rhyme_jax.data.rewards import reward
from rhyme_jax.model.tokenizer import Tokenizer
from rhyme_jax.rollout.engine import RolloutEngine, SamplingParams


@dataclass(frozen=True)
class EvalResult:
    """Accuracy of greedy decoding on ``n`` held-out problems.

    ``accuracy`` in [0, 1]; ``stderr`` = sqrt(acc (1 - acc) / n) (binomial standard error);
    ``mean_length`` in tokens; ``correct`` is a per-problem 0/1 vector (input order).
    """

    accuracy: float
    stderr: float
    n: int
    mean_length: float
    correct: np.ndarray

    def as_metrics(self, prefix: str = "eval") -> dict[str, float]:
        return {f"{prefix}/accuracy": self.accuracy, f"{prefix}/stderr": self.stderr,
                f"{prefix}/n": float(self.n), f"{prefix}/response_length": self.mean_length}


def encode_prompts(tokenizer: Tokenizer, problems: Sequence[Problem], template: str) -> list[list[int]]:
    """Token ids of each problem's formatted prompt."""
    return [tokenizer.encode(tokenizer.format_prompt(template, p.question)) for p in problems]


def evaluate(engine: RolloutEngine, state, tokenizer: Tokenizer, problems: Sequence[Problem], *,
             template: str, max_new_tokens: int, key: jax.Array | None = None,
             reward_fn: Callable[[str, Problem], float] = reward) -> EvalResult:
    """Greedy (temperature 0) accuracy of the policy ``state`` on ``problems``.

    Raises:
      ValueError: ``problems`` is empty.
    """
    if not problems:
        raise ValueError("evaluate: no problems (check data.num_eval)")
    prompts = encode_prompts(tokenizer, problems, template)
    out = engine.generate(state, prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens),
                          key if key is not None else jax.random.key(0))
    correct = np.array([reward_fn(tokenizer.decode(toks), p) for toks, p in zip(out.tokens, problems)],
                       dtype=np.float64)
    acc = float(correct.mean())
    return EvalResult(accuracy=acc, stderr=math.sqrt(max(acc * (1 - acc), 0.0) / len(problems)),
                      n=len(problems), mean_length=float(np.mean([len(t) for t in out.tokens])),
                      correct=correct)
