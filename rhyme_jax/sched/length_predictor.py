"""HistoPipe length predictor: a prompt's next response length from its last rollout.

RhymeRL (arXiv 2508.18588, s.5 "HistoPipe") observes that a prompt keeps its
length rank between adjacent epochs, so the lengths of its previous rollout predict the next one.
Per prompt the prediction is a statistic (``mean``, ``max`` or ``p90``) of the n response lengths of
its last rollout; prompts without history get the median of the seen prompts' predictions in the
same batch (the batch median), and when no prompt of the batch has history every prompt gets
``default`` (e.g. ``rollout.max_new_tokens / 2``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from jaxtyping import Float

STATS = ("mean", "max", "p90")


def _stat(lengths: np.ndarray, stat: str) -> float:
    if stat == "mean":
        return float(lengths.mean())
    if stat == "max":
        return float(lengths.max())
    return float(np.percentile(lengths, 90))  # linear interpolation between order statistics


def predict_lengths(
    history: Any,
    prompt_ids,
    stat: str = "mean",
    *,
    default: float | None = None,
) -> Float[np.ndarray, "P"]:
    """Predicted response length (tokens) of each prompt of a step.

    Args:
      history: a ``rhyme_jax.spec.history.HistoryStore`` (``history.lengths(pid)`` -> ``int32[n]``
        lengths of the prompt's last rollout, or None), or a mapping ``prompt id -> int[n]``
        lengths (missing key = no history; used by the replay benchmark).
      prompt_ids: ``int[P]`` prompt ids of the step (one per prompt, not per sample).
      stat: ``"mean"``, ``"max"`` or ``"p90"`` (90th percentile, linear interpolation) of the
        last rollout's lengths (config ``sched.length_stat``).
      default: prediction for every prompt when none of them has history (cold start). Required
        only in that case.

    Returns:
      ``float64[P]`` predicted lengths in tokens. Prompts without history (or with an empty
      rollout) get the median of the other prompts' predictions.

    Raises:
      ValueError: unknown ``stat`` (names ``sched.length_stat``); no prompt has history and
        ``default`` is None; ``prompt_ids`` is not 1-D.
    """
    if stat not in STATS:
        raise ValueError(f"sched.length_stat: expected one of {list(STATS)}, got {stat!r}")
    ids = np.asarray(prompt_ids)
    if ids.ndim != 1:
        raise ValueError(f"prompt_ids: expected a 1-D array of prompt ids, got shape {ids.shape}")
    lookup = history.get if isinstance(history, Mapping) else history.lengths
    pred = np.full(ids.shape[0], np.nan, dtype=np.float64)
    for i, pid in enumerate(ids.tolist()):
        lengths = lookup(int(pid))
        if lengths is not None and np.size(lengths):
            pred[i] = _stat(np.asarray(lengths, dtype=np.float64), stat)
    seen = ~np.isnan(pred)
    if seen.all():
        return pred
    if seen.any():
        pred[~seen] = float(np.median(pred[seen]))
        return pred
    if default is None:
        raise ValueError("predict_lengths: no prompt of the batch has history; pass default= "
                         "(e.g. rollout.max_new_tokens / 2)")
    pred[:] = float(default)
    return pred
