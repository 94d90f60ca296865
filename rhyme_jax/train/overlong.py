"""Responses that run into the length budget: DAPO's soft overlong punishment and overlong filtering.

DAPO (Yu et al., arXiv 2503.14476, sec. 3.4 "Overlong Reward Shaping") treats a response cut at
the budget two ways, each a switch here:

* ``reward.soft_overlong_cache`` (``soft_overlong_penalty``, eq. 13; TRL
  ``trl.rewards.get_soft_overlong_punishment(max_completion_len, soft_punish_cache)``, verl
  ``reward_model.overlong_buffer``): a length penalty added to the reward, 0 up to
  ``L_max - L_cache`` tokens, then falling linearly to ``-soft_overlong_factor`` at ``L_max``
  (``L_max`` = ``rollout.max_new_tokens``, ``L_cache`` = ``reward.soft_overlong_cache``).
* ``grpo.mask_truncated_completions`` (``mask_rows``; TRL's key of that name, DAPO's "overlong
  filtering"): rows that hit ``rollout.max_new_tokens`` without EOS (finish ``"length"``) carry
  no loss tokens. Their rewards still enter their group's advantage baseline (as in TRL).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from jaxtyping import Bool, Float, Int


def soft_overlong_penalty(lengths: Int[np.ndarray, "N"] | Sequence[int], max_len: int, cache: int,
                          factor: float = 1.0) -> Float[np.ndarray, "N"]:
    """DAPO eq. 13 times ``factor``: ``float32[N]`` penalties of responses of ``lengths`` tokens
    (the EOS token included when one ended the response, as TRL's completion ids count it).

    ``0`` for ``|y| <= max_len - cache``; ``factor x ((max_len - cache) - |y|) / cache`` in
    ``(max_len - cache, max_len]``; ``-factor`` beyond ``max_len``. With ``factor = 1`` equal to
    TRL's ``get_soft_overlong_punishment(max_len, cache)`` (tests/test_overlong.py). ``cache = 0``:
    all zeros (off).

    Raises:
      ValueError: ``cache`` not in ``[0, max_len]``.
    """
    lengths = np.asarray(lengths, np.float64)
    if not 0 <= cache <= max_len:
        raise ValueError(f"soft_overlong_penalty: cache={cache} must be in [0, max_len={max_len}] "
                         f"(reward.soft_overlong_cache, rollout.max_new_tokens)")
    if cache == 0:
        return np.zeros(lengths.shape, np.float32)
    ramp = np.clip(((max_len - cache) - lengths) / cache, -1.0, 0.0)
    return (factor * ramp).astype(np.float32)


def mask_rows(loss_mask: Float[np.ndarray, "N T"], drop: Bool[np.ndarray, "N"]) -> Float[np.ndarray, "N T"]:
    """``loss_mask`` (``losses.sequence_batch``'s ``float32[N, T]``) with the rows ``drop`` zeroed:
    they carry no loss tokens, so they drop out of every token count (``token_mean``, the
    ``step_token_mean`` normaliser, ``seq_mean_token_mean``'s rows; ``seq_mean_token_sum_norm``
    still counts them as rows, as TRL ``dr_grpo`` does)."""
    return loss_mask * ~np.asarray(drop, bool)[:, None]
