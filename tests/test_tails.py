"""The drafter's tails (rhyme_jax/rollout/tails.py) against a plain list per slot."""

import numpy as np
import pytest

from rhyme_jax.rollout.tails import SLACK, ContextTails


def _expected(seq, w):
    return np.array(([-1] * w + seq)[-w:], np.int32)


def test_tails_match_the_last_tokens_through_many_appends_and_moves():
    rng = np.random.default_rng(0)
    w, slots = 5, 4
    tails = ContextTails(slots, w)
    seqs = [list(rng.integers(0, 50, rng.integers(1, 9))) for _ in range(slots)]
    for s, seq in enumerate(seqs):
        tails.reset(s, np.array(seq))
    moved = 0
    for step in range(300):
        ids = np.sort(rng.choice(slots, rng.integers(1, slots + 1), replace=False))
        k = int(rng.integers(1, 12))
        toks = rng.integers(0, 50, (ids.size, k)).astype(np.int32)
        counts = rng.integers(1, k + 1, ids.size)
        before = tails.end[ids].copy()
        tails.append(ids, toks, counts)
        moved += int((tails.end[ids] < before + counts).sum())
        for i, s in enumerate(ids):
            seqs[s] += list(toks[i, :counts[i]])
        if step % 50 == 49:  # a slot is handed to a new sequence
            s = int(rng.integers(slots))
            seqs[s] = list(rng.integers(0, 50, 3))
            tails.reset(s, np.array(seqs[s]))
        got = tails.get(np.arange(slots))
        assert got.dtype == np.int32 and got.shape == (slots, w)
        for s in range(slots):
            np.testing.assert_array_equal(got[s], _expected(seqs[s], w))
    assert moved > 10  # the buffer wrapped many times


def test_append_refuses_more_tokens_than_the_room():
    tails = ContextTails(2, 3)
    with pytest.raises(ValueError, match="tails.py"):
        tails.append(np.array([0]), np.zeros((1, 3 + SLACK + 1), np.int32), np.array([3 + SLACK + 1]))
    with pytest.raises(ValueError, match="width"):
        ContextTails(2, 0)
