"""DAPO dynamic sampling (``grpo.dynamic_sampling``): a step trains only groups whose rewards
differ, refilled with fresh prompts.

A group whose n rewards are all equal has advantage 0 on every row (the baseline is the group's
mean under every ``grpo.scale_rewards``), so it adds no policy gradient, yet it counts in the
batch; as the policy gets more prompts all right or all wrong, fewer groups carry a signal.
DAPO (Yu et al., arXiv 2503.14476, sec. 3.2 "Dynamic Sampling"; verl ``algorithm.filter_groups``)
drops those groups and samples more until the batch is full. Here, after the step's rollout is
scored (``fill_batch``):

1. groups whose rewards are all equal are dropped (``has_signal``);
2. while fewer than ``grpo.prompts_per_step`` groups are kept and fewer than
   ``grpo.refill_rounds`` refill rounds ran, round k rolls out fresh prompts (``refill_prompts``:
   prompts of the GRPO prompt set not yet rolled out at the step, in an order drawn from
   ``(run.seed, step, k)``), as many as the groups still missing divided by the share of groups
   kept so far (``refill_size``), scores them and keeps those with a signal;
3. the first ``grpo.prompts_per_step`` kept groups train (the step's own first, then the rounds'
   in order; kept groups beyond them are unused). Still short after the last round, the step
   trains on the groups it has and logs how many are missing (docs/dynamic_sampling.md).

Every group rolled out, dropped ones included, is written back (the step's rollouts file, the
history store). Resumption stays exact: a round's prompts and sampling key are functions of
``(run.seed, step, round)`` and of the step's rewards.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from jaxtyping import Bool, Float, Int

from rhyme_jax.train.step_batch import StepBatch

REFILL_STREAM = 0xD5  # last word of a refill round's prompt-order seed (the step schedule's seeds have two)


def has_signal(group_rewards: Float[np.ndarray, "G n"]) -> Bool[np.ndarray, "G"]:
    """``bool[G]``: groups whose rewards are not all equal (a nonzero advantage somewhere). A group
    with a NaN reward has none either (its advantages would be NaN)."""
    r = np.asarray(group_rewards, np.float64)
    return np.isfinite(r).all(axis=1) & (r.max(axis=1) > r.min(axis=1)) if r.size else np.zeros(len(r), bool)


def refill_size(missing: int, kept: int, scored: int, per_step: int) -> int:
    """Prompts of the next refill round: ``ceil(missing x scored / kept)`` (the groups still
    missing over the share kept so far), at most ``per_step`` (one step's batch, DAPO's generation
    batch); ``per_step`` when nothing was kept yet. 0 when nothing is missing."""
    if missing <= 0:
        return 0
    if kept <= 0:
        return per_step
    return min(per_step, math.ceil(missing * scored / kept))


def refill_prompts(seed: int, step: int, round_: int, prompt_set: int, count: int,
                   used: set[int]) -> Int[np.ndarray, "k"]:
    """``int64[k <= count]`` prompts of refill round ``round_`` of step ``step``: the GRPO prompt
    set ``[0, prompt_set)`` without ``used`` (prompts already rolled out at the step), in a
    permutation seeded by ``(seed, step, round_)``; fewer than ``count`` when the set runs out."""
    order = np.random.default_rng([seed, step, round_, REFILL_STREAM]).permutation(prompt_set)
    return order[~np.isin(order, np.fromiter(used, np.int64, len(used)))][:count].astype(np.int64)


@dataclass
class Filled:
    """A step's batch after dynamic sampling.

    Attributes:
      scored: every group rolled out and scored at the step (the step's own rollout, then each
        refill round's), the one written back; its ``rollout`` is the step's own.
      trained: the groups to train (at most ``grpo.prompts_per_step`` with a signal).
      metrics: the ``dynamic_sampling/*`` keys of the step's metrics row (docs/metrics.md).
    """

    scored: StepBatch
    trained: StepBatch
    metrics: dict[str, float]


def fill_batch(sb: StepBatch, *, per_step: int, max_rounds: int, prompt_set: int, seed: int,
               rollout: Callable[[int, np.ndarray], StepBatch],
               score: Callable[[StepBatch], np.ndarray]) -> Filled:
    """Drop the scored ``sb``'s groups without a signal and refill (module docstring).

    Args:
      sb: the step's batch, scored (``StepBatch.set_rewards``).
      per_step: groups a step trains (``grpo.prompts_per_step``); max_rounds: ``grpo.refill_rounds``.
      prompt_set: size of the GRPO prompt set (``prompts.num_grpo_prompts``); seed: ``run.seed``.
      rollout: ``(round, int64[P'] prompts) -> StepBatch``, a refill round rolled out
        (``RolloutPipeline.refill``); score: ``StepBatch -> float32[N]`` its rewards.

    Returns:
      ``Filled``.
    """
    t0 = time.perf_counter()
    groups = list(sb.groups)
    kept = [grp for grp, ok in zip(groups, has_signal(sb.group_rewards) if groups else []) if ok]
    rounds = extra_rows = 0
    while len(kept) < per_step and rounds < max_rounds:
        size = refill_size(per_step - len(kept), len(kept), len(groups), per_step)
        used = {grp.prompt_idx for grp in groups + sb.carry}
        idx = refill_prompts(seed, sb.step, rounds + 1, prompt_set, size, used)
        if not len(idx):
            break  # every prompt of the set was rolled out at this step
        rounds += 1
        rb = rollout(rounds, idx)
        rb.set_rewards(score(rb))
        extra_rows += len(rb.tokens)
        groups += rb.groups
        kept += [grp for grp, ok in zip(rb.groups, has_signal(rb.group_rewards)) if ok]
    scored = dataclasses.replace(sb, groups=groups)
    trained = dataclasses.replace(sb, groups=kept[:per_step])
    rewards = scored.rewards
    metrics = {
        "dynamic_sampling/filtered_share": 1.0 - len(kept) / max(len(groups), 1),
        "dynamic_sampling/refill_rounds": float(rounds),
        "dynamic_sampling/extra_rows": float(extra_rows),
        "dynamic_sampling/missing_groups": float(max(per_step - len(trained.groups), 0)),
        "dynamic_sampling/unused_groups": float(max(len(kept) - per_step, 0)),
        "dynamic_sampling/reward_mean": float(np.nanmean(rewards)) if np.isfinite(rewards).any() else float("nan"),
        "dynamic_sampling/refill_s": time.perf_counter() - t0,
    }
    return Filled(scored, trained, metrics)
