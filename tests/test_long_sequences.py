"""``rhyme_lab.measure.long_sequences``: the history store, suffix index and rollout log hold a
sequence in memory linear in its length (a fixed number of bytes per token, whatever the length)."""

from __future__ import annotations

import numpy as np

from rhyme_lab.measure.long_sequences import history_growth, log_growth


def test_history_index_and_log_bytes_grow_linearly_with_length():
    rng = np.random.default_rng(0)
    short, long = history_growth(256, 2, 512, rng), history_growth(4096, 2, 512, rng)
    # A suffix automaton over n tokens has at most 2n states and 3n transitions (Blumer et al.
    # 1985). The index keeps 28 bytes per state (length, link, counts: 4 x int32 + an f64 reward
    # sum), 8 per transition (token, target) and a hash table of at most 4 int32 slots per
    # transition (a power of two), so at most 2 x 28 + 3 x 8 + 12 x 4 = 128 bytes per token.
    for L, r in ((256, short), (4096, long)):
        n = 2 * (L + 1 + 5) + 32  # each response with SEP and the prompt head, and the prompt
        assert r["index_states"] <= 2 * n and r["index_bytes"] <= 128 * n, (L, r)
    # the stored tokens are int32: 4 bytes per token plus a fixed header and per-row offsets
    assert 4 * 2 * 4096 <= long["store_bytes"] <= 4 * 2 * 4096 + 4096
    s, l = log_growth(256, 2, 512, rng), log_growth(4096, 2, 512, rng)
    # at most an int32 token and a float32 logprob per token (the npz is compressed) plus a
    # fixed header, so the bytes per token do not grow with the length
    assert l <= 8 * 2 * 4096 + 2048 and l / 4096 <= s / 256
