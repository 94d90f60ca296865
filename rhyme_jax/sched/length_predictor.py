"""HistoPipe's length predictor: ``spec.lengths.predict_lengths`` with the planner's fallback.

The planner ranks and sizes groups by length, so every prompt needs one: a prompt without history
gets the batch median (the median of the seen prompts' predictions in the same batch), and when no
prompt of the batch has history every prompt gets ``default`` (e.g. ``rollout.max_new_tokens / 2``).
The statistic itself (mean / max / p90 of the last rollout's lengths) is ``rhyme_jax.spec.lengths``,
shared with the goodput drafter's makespan priority.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jaxtyping import Float

from rhyme_jax.spec import lengths
from rhyme_jax.spec.lengths import STATS

__all__ = ["STATS", "predict_lengths"]


def predict_lengths(
    history: Any,
    prompt_ids,
    stat: str = "mean",
    *,
    default: float | None = None,
) -> Float[np.ndarray, "P"]:
    """Predicted response length (tokens) of each prompt of a step, unseen prompts at the batch median.

    Args:
      history: a ``rhyme_jax.spec.history.HistoryStore`` or a mapping ``prompt id -> int[n]``
        lengths (as ``spec.lengths.predict_lengths``).
      prompt_ids: ``int[P]`` prompt ids of the step (one per prompt, not per sample).
      stat: ``"mean"``, ``"max"`` or ``"p90"`` of the last rollout's lengths (``sched.length_stat``).
      default: prediction for every prompt when none of them has history (cold start). Required
        only in that case.

    Returns:
      ``float64[P]`` predicted lengths in tokens. Prompts without history (or with an empty
      rollout) get the median of the other prompts' predictions.

    Raises:
      ValueError: unknown ``stat`` (names ``sched.length_stat``); no prompt has history and
        ``default`` is None; ``prompt_ids`` is not 1-D.
    """
    return lengths.predict_lengths(history, prompt_ids, stat, unseen="median", default=default)
