"""The shared length predictor (``rhyme_jax.spec.lengths``): last rollout's mean / max / p90 and each
caller's fallback for a prompt without history (planner: batch median; drafter priority: 0)."""

import numpy as np
import pytest

from rhyme_jax.sched import length_predictor
from rhyme_jax.spec.history import HistoryStore
from rhyme_jax.spec.lengths import STATS, predict_lengths


def _store() -> HistoryStore:
    """Prompt 1's last rollout has lengths [3, 5, 10]; prompt 2's [4, 4] (an older rollout of
    prompt 2, lengths [100, 100], must not count)."""
    h = HistoryStore()
    tok = lambda k: np.zeros(k, np.int32)  # noqa: E731
    h.update(0, np.array([2, 2]), [np.array([7])] * 2, [tok(100), tok(100)], np.zeros(2))
    h.update(1, np.array([1, 1, 1, 2, 2]), [np.array([5])] * 3 + [np.array([7])] * 2,
             [tok(3), tok(5), tok(10), tok(4), tok(4)], np.zeros(5))
    return h


def test_stats_of_the_last_rollout():
    h = _store()
    assert STATS == ("mean", "max", "p90")
    np.testing.assert_array_equal(predict_lengths(h, [1, 2], "mean", unseen=0.0), [6.0, 4.0])
    np.testing.assert_array_equal(predict_lengths(h, [1, 2], "max", unseen=0.0), [10.0, 4.0])
    # p90 of [3, 5, 10], linear interpolation: 5 + 0.8 * (10 - 5)
    np.testing.assert_allclose(predict_lengths(h, [1, 2], "p90", unseen=0.0), [9.0, 4.0])
    out = predict_lengths({1: [2, 4], 2: np.array([8], np.int32)}, np.array([2, 1, 2]), unseen=0.0)
    assert out.dtype == np.float64 and out.tolist() == [8.0, 3.0, 8.0]  # a mapping; repeated ids


def test_unseen_fallback_is_the_callers():
    h = _store()
    # the planner: unseen prompts at the median of the seen ones (6 and 4 -> 5)
    np.testing.assert_array_equal(predict_lengths(h, [1, 9, 2], unseen="median"), [6.0, 5.0, 4.0])
    # the drafter's priority: unseen prompts at 0, even when no prompt has history (no default needed)
    np.testing.assert_array_equal(predict_lengths(h, [1, 9, 2], unseen=0.0), [6.0, 0.0, 4.0])
    np.testing.assert_array_equal(predict_lengths(h, [8, 9], unseen=0.0), [0.0, 0.0])
    # an empty rollout counts as no history
    np.testing.assert_array_equal(predict_lengths({1: [], 2: [6]}, [1, 2], unseen="median"), [6.0, 6.0])
    # cold start with the median fallback: default, or an error naming it
    np.testing.assert_array_equal(predict_lengths(h, [8, 9], unseen="median", default=16.0), [16.0, 16.0])
    with pytest.raises(ValueError, match="default="):
        predict_lengths(h, [8, 9], unseen="median")
    assert predict_lengths(h, [], unseen=0.0).shape == (0,)


def test_errors_and_the_planner_binding():
    h = _store()
    with pytest.raises(ValueError, match="sched.length_stat"):
        predict_lengths(h, [1], "median", unseen=0.0)
    with pytest.raises(ValueError, match="1-D"):
        predict_lengths(h, [[1]], unseen=0.0)
    with pytest.raises(TypeError, match="unseen"):
        predict_lengths(h, [1])  # each caller names its fallback
    for stat in STATS:  # sched.length_predictor is the median-fallback binding of the same predictor
        np.testing.assert_array_equal(length_predictor.predict_lengths(h, [1, 9, 2], stat),
                                      predict_lengths(h, [1, 9, 2], stat, unseen="median"))
