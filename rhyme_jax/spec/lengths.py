"""Length prediction from the history store: a prompt's next response length from its last rollout.

RhymeRL (arXiv 2508.18588, s.5 "HistoPipe") observes that a prompt keeps its length rank between
adjacent epochs, so the lengths of its previous rollout predict the next one. Per prompt the
prediction is a statistic (``mean``, ``max`` or ``p90``) of the n response lengths of its last
rollout, as the history store (``history.HistoryStore.lengths``) keeps them.

One predictor, two callers, each with its own fallback for a prompt without history (``unseen``):

* HistoPipe's planner (``rhyme_jax.sched.length_predictor``) needs a length for every group it
  ranks and sizes, so an unseen prompt gets the batch median (``unseen="median"``: the median of
  the seen prompts' predictions in the same call; ``default`` when no prompt has history).
* The goodput drafter's makespan priority (``drafter.Drafter.batch``) orders rows by the work the
  history says they have left; a row without history has no such claim, so it gets 0
  (``unseen=0.0``) and ranks last.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
from jaxtyping import Float

STATS = ("mean", "max", "p90")


def _stat(lengths: np.ndarray, stat: str) -> float:
    if stat == "mean":
        return float(lengths.mean())
    if stat == "max":
        return float(lengths.max())
    return float(np.percentile(lengths, 90))  # linear interpolation between order statistics


def _fill_unseen(pred: np.ndarray, unseen: Literal["median"] | float, default: float | None) -> np.ndarray:
    """``pred`` with its NaN entries (prompts without history) replaced by the ``unseen`` fallback."""
    seen = ~np.isnan(pred)
    if seen.all():
        return pred
    if unseen != "median":
        pred[~seen] = float(unseen)
        return pred
    if seen.any():
        pred[~seen] = float(np.median(pred[seen]))
        return pred
    if default is None:
        raise ValueError("predict_lengths: no prompt of the batch has history; pass default= "
                         "(e.g. rollout.max_new_tokens / 2)")
    pred[:] = float(default)
    return pred


def predict_lengths(
    history: Any,
    prompt_ids,
    stat: str = "mean",
    *,
    unseen: Literal["median"] | float,
    default: float | None = None,
) -> Float[np.ndarray, "P"]:
    """Predicted response length (tokens) of each prompt id.

    Args:
      history: a ``rhyme_jax.spec.history.HistoryStore`` (``history.lengths(pid)`` -> ``int32[n]``
        lengths of the prompt's last rollout, or None), or a mapping ``prompt id -> int[n]``
        lengths (missing key = no history; used by the replay benchmark).
      prompt_ids: ``int[P]`` prompt ids (a repeated id gets the same prediction each time).
      stat: ``"mean"``, ``"max"`` or ``"p90"`` (90th percentile, linear interpolation) of the
        last rollout's lengths (config ``sched.length_stat``).
      unseen: prediction for a prompt without history (or with an empty rollout): ``"median"``,
        the median of the seen prompts' predictions (the planner), or a number of tokens (the
        drafter's priority uses 0). Module docstring: why the callers differ.
      default: with ``unseen="median"``, the prediction for every prompt when none of them has
        history (cold start). Required only in that case; ignored with a numeric ``unseen``.

    Returns:
      ``float64[P]`` predicted lengths in tokens.

    Raises:
      ValueError: unknown ``stat`` (names ``sched.length_stat``); ``unseen="median"``, no prompt
        has history and ``default`` is None; ``prompt_ids`` is not 1-D.
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
    return _fill_unseen(pred, unseen, default)
