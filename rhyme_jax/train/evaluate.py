"""Held-out evaluation through the paged engine, scored by the task reward.

Two accuracies: greedy (temperature 0, one response per problem) and, optionally, sampled
``mean@k`` (k responses per problem at the rollout temperature; the policy RL optimises). Both
carry a standard error over problems: binomial for greedy, the standard error of per-problem
means for mean@k (samples of one problem are correlated, so problems are the unit).
"""

from __future__ import annotations

import math
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from rhyme_jax.config import RunConfig
from rhyme_jax.data import Problem
from rhyme_jax.data.custom_reward import score_batch, task_reward
from rhyme_jax.data.rewards import reward
from rhyme_jax.io.atomic import atomic_write
from rhyme_jax.model.tokenizer import Tokenizer
from rhyme_jax.rollout.engine import RolloutEngine, SamplingParams


@dataclass(frozen=True)
class EvalResult:
    """Accuracy on ``n`` held-out problems.

    ``accuracy`` in [0, 1] (greedy); ``stderr`` = sqrt(acc (1 - acc) / n); ``mean_length`` in
    tokens; ``correct`` is a per-problem 0/1 vector (input order). ``sampled_accuracy`` /
    ``sampled_stderr``: mean@k at the sampling temperature (None when not measured).
    """

    accuracy: float
    stderr: float
    n: int
    mean_length: float
    correct: np.ndarray
    sampled_accuracy: Optional[float] = None
    sampled_stderr: Optional[float] = None
    samples: int = 0
    sampled_per_problem: Optional[np.ndarray] = None  # f64[n]: share of the k samples correct

    @property
    def pass_at_k(self) -> Optional[float]:
        """pass@k with k = ``samples``: share of problems with at least one correct sample of k
        (None when not measured). GRPO moves pass@1 towards it (Chen et al. 2021, arXiv 2107.03374)."""
        if self.sampled_per_problem is None:
            return None
        return float(np.mean(self.sampled_per_problem > 0))

    def save(self, path: Path) -> None:
        """Per-problem results as ``.npz`` (``correct``, ``sampled``), written atomically."""
        with atomic_write(path, "wb") as fh:
            np.savez(fh, correct=self.correct,
                     sampled=self.sampled_per_problem if self.sampled_per_problem is not None
                     else np.zeros(0))

    def as_metrics(self, prefix: str = "eval") -> dict[str, float]:
        out = {f"{prefix}/accuracy": self.accuracy, f"{prefix}/stderr": self.stderr,
               f"{prefix}/n": float(self.n), f"{prefix}/response_length": self.mean_length}
        if self.sampled_accuracy is not None:
            out.update({f"{prefix}/sampled_accuracy": self.sampled_accuracy,
                        f"{prefix}/sampled_stderr": self.sampled_stderr,
                        f"{prefix}/samples": float(self.samples),
                        f"{prefix}/pass_at_k": self.pass_at_k})
        return out


def encode_prompts(tokenizer: Tokenizer, problems: Sequence[Problem], template: str) -> list[list[int]]:
    """Token ids of each problem's formatted prompt."""
    return [tokenizer.encode(tokenizer.format_prompt(template, p.question)) for p in problems]


def _score(engine, state, tokenizer, problems, prompts, sampling, key, reward_fn, k):
    out = engine.generate(state, [p for p in prompts for _ in range(k)], sampling, key)
    rewards = np.array(score_batch(reward_fn, [tokenizer.decode(toks) for toks in out.tokens],
                                   [q for q in problems for _ in range(k)]),
                       dtype=np.float64).reshape(len(problems), k)
    return rewards, float(np.mean([len(t) for t in out.tokens]))


def evaluate(engine: RolloutEngine, state, tokenizer: Tokenizer, problems: Sequence[Problem], *,
             template: str, max_new_tokens: int, key: jax.Array | None = None,
             samples: int = 0, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             reward_fn: Callable[[str, Problem], float] = reward) -> EvalResult:
    """Greedy accuracy of the policy ``state`` on ``problems`` and, when ``samples > 0``, its
    mean@``samples`` accuracy at ``temperature`` / ``top_k`` / ``top_p``.

    Raises:
      ValueError: ``problems`` is empty.
    """
    if not problems:
        raise ValueError("evaluate: no problems (check data.num_eval)")
    key = key if key is not None else jax.random.key(0)
    prompts = encode_prompts(tokenizer, problems, template)
    greedy, mean_len = _score(engine, state, tokenizer, problems, prompts,
                              SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens),
                              key, reward_fn, 1)
    correct = greedy[:, 0]
    acc, n = float(correct.mean()), len(problems)
    sampled_acc = sampled_se = None
    if samples > 0:
        per_problem, _ = _score(engine, state, tokenizer, problems, prompts,
                                SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                               max_new_tokens=max_new_tokens),
                                jax.random.fold_in(key, 1), reward_fn, samples)
        means = per_problem.mean(axis=1)
        sampled_acc = float(means.mean())
        sampled_se = float(means.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0
    return EvalResult(accuracy=acc, stderr=math.sqrt(max(acc * (1 - acc), 0.0) / n), n=n,
                      mean_length=mean_len, correct=correct, sampled_accuracy=sampled_acc,
                      sampled_stderr=sampled_se, samples=samples,
                      sampled_per_problem=means if samples > 0 else None)


def evaluate_run(engine: RolloutEngine, state, tokenizer: Tokenizer, problems: Sequence[Problem],
                 cfg: RunConfig, reward_fn: Callable[[str, Problem], float] | None = None) -> EvalResult:
    """``evaluate`` with the settings of a run config (``model.prompt_template``,
    ``rollout.*`` sampling, ``run.eval_samples``, key from ``run.seed``); the reward defaults to
    the config's (``reward.fn``, else the built-in reward of ``data.answer_extraction``).

    Raises:
      RewardError: ``reward.fn`` cannot be used, or returned a value that is not a finite number.
    """
    r = cfg.rollout
    reward_fn = reward_fn or task_reward(cfg)
    return evaluate(engine, state, tokenizer, problems, template=cfg.model.prompt_template,
                    max_new_tokens=r.max_new_tokens, key=jax.random.key(cfg.run.seed + 7919),
                    samples=cfg.run.eval_samples, temperature=r.temperature, top_k=r.top_k,
                    top_p=r.top_p, reward_fn=reward_fn)


