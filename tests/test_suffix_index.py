"""HistoSpec suffix index vs a brute-force matcher over the indexed strings."""

import numpy as np
import pytest

from rhyme_jax.spec.suffix_index import END, SEP, IndexPack, SuffixIndex, draft_batch

REWARDS = np.array([0.0, 0.25, 0.5, 1.0])  # dyadic: sums are exact in any order


def _strings(prompt, responses, rewards):
    """The indexed strings with the reward of their response (None for the plain prompt)."""
    head = list(prompt[-5:]) if len(prompt) else []
    out = [(list(prompt) + [END], None)]
    out += [(head + list(r) + [SEP], float(w)) for r, w in zip(responses, rewards)]
    return out


def _occurrences(strings, pat):
    m = len(pat)
    return [(s, k) for s, (toks, _) in enumerate(strings)
            for k in range(len(toks) - m + 1) if toks[k:k + m] == pat]


def _brute_draft(strings, tail, max_len, branch, min_prob, pmax=7, pmin=3):
    tail = [int(t) for t in tail]
    if any(t < 0 for t in tail):
        tail = tail[max(i for i, t in enumerate(tail) if t < 0) + 1:]
    tail = tail[-pmax:]
    pat = None
    for n in range(min(pmax, len(tail)), pmin - 1, -1):
        if n and _occurrences(strings, tail[len(tail) - n:]):
            pat = tail[len(tail) - n:]
            break
    if pat is None:
        return []
    out, prob = [], 1.0
    while len(out) < max_len:
        occ = _occurrences(strings, pat)
        tally = {}  # next token -> [count, response count, reward sum]
        for s, k in occ:
            toks, rw = strings[s]
            t = tally.setdefault(toks[k + len(pat)], [0, 0, 0.0])
            t[0] += 1
            if rw is not None:
                t[1] += 1
                t[2] += rw

        def key(item):
            tok, (c, rc, rs) = item
            if branch == "count":
                return (c, -tok)
            return (rc > 0, rs / rc if rc else 0.0, c, -tok)

        tok, (c, _, _) = max(tally.items(), key=key)
        if tok < 0:
            break
        p = prob * (c / len(occ))
        if p < min_prob:
            break
        prob = p
        out.append(tok)
        pat = pat + [tok]
    return out


def _random_history(rng, vocab):
    prompt = rng.integers(0, vocab, rng.integers(0, 12))
    base = rng.integers(0, vocab, rng.integers(5, 30))
    responses = []
    for _ in range(rng.integers(0, 6)):
        r = base.copy()  # rhyming responses: one base with random edits, cut at random
        edits = rng.integers(0, len(r), rng.integers(0, 4))
        r[edits] = rng.integers(0, vocab, edits.size)
        responses.append(r[: rng.integers(0, len(r) + 1)])
    return prompt, responses, rng.choice(REWARDS, len(responses))


def _tails(rng, strings, vocab, n):
    """Random tails: slices of the indexed strings (matches), random tokens, left padding."""
    out = []
    for _ in range(n):
        toks = [t for t in strings[rng.integers(len(strings))][0] if t >= 0] or [0]
        end = rng.integers(0, len(toks) + 1)
        tail = list(toks[max(0, end - 9):end]) if rng.random() < 0.7 else list(rng.integers(0, vocab, 8))
        if tail and rng.random() < 0.3:
            tail[0] = int(rng.integers(0, vocab))
        width = int(rng.integers(len(tail), len(tail) + 3))
        out.append(np.array([-1] * (width - len(tail)) + tail, dtype=np.int32))
    return out


@pytest.mark.parametrize("seed", list(range(6)) + [pytest.param(s, marks=pytest.mark.slow)
                                                   for s in range(6, 40)])
def test_draft_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    vocab = 3 + seed % 3
    checked = nonempty = 0
    for _ in range(8):
        prompt, responses, rewards = _random_history(rng, vocab)
        ix = SuffixIndex.build(prompt, responses, rewards)
        strings = _strings(prompt, responses, rewards)
        for tail in _tails(rng, strings, vocab, 12):
            for branch in ("reward", "count"):
                for min_prob in (0.0, 0.1, 0.5):
                    max_len = int(rng.integers(0, 12))
                    want = _brute_draft(strings, tail, max_len, branch, min_prob)
                    got = ix.draft(tail, max_len, branch=branch, min_token_prob=min_prob)
                    assert got.dtype == np.int32
                    assert got.tolist() == want, (tail, branch, min_prob, max_len)
                    checked += 1
                    nonempty += bool(want)
        # pattern lengths other than the defaults
        for tail in _tails(rng, strings, vocab, 4):
            want = _brute_draft(strings, tail, 8, "reward", 0.1, pmax=4, pmin=2)
            assert ix.draft(tail, 8, branch="reward", min_token_prob=0.1, pattern_max=4,
                            pattern_min=2).tolist() == want
    assert nonempty > checked // 8  # the cases exercise real walks, not just empty drafts


@pytest.mark.parametrize("seed", range(3))
def test_counts_equal_occurrences(seed):
    rng = np.random.default_rng(100 + seed)
    for _ in range(10):
        prompt, responses, rewards = _random_history(rng, 3)
        ix = SuffixIndex.build(prompt, responses, rewards)
        strings = _strings(prompt, responses, rewards)
        n = sum(len(s) for s, _ in strings)
        assert ix.num_states <= 2 * n  # linear-size structure
        for m in range(1, 6):
            for _ in range(6):
                pat = [int(t) for t in rng.integers(0, 3, m)]
                assert ix.count(np.array(pat)) == len(_occurrences(strings, pat)), pat


def test_longest_match_and_reward_rules():
    # After "1 2 3" the majority continuation is 9, but the longer context "7 1 2 3" continues 5.
    responses = [np.array([7, 1, 2, 3, 5, 5]), np.array([8, 1, 2, 3, 9]), np.array([6, 1, 2, 3, 9])]
    ix = SuffixIndex.build(np.array([], np.int64), responses, np.array([0.0, 1.0, 1.0]))
    assert ix.draft(np.array([7, 1, 2, 3]), 4, branch="count", min_token_prob=0).tolist() == [5, 5]
    assert ix.draft(np.array([4, 1, 2, 3]), 4, branch="count", min_token_prob=0).tolist() == [9]
    # Reward: the 1-reward child wins over a higher count; count policy takes the majority.
    resp = [np.array([1, 2, 3, 4]), np.array([1, 2, 3, 5]), np.array([1, 2, 3, 5])]
    ix = SuffixIndex.build(np.array([0]), resp, np.array([1.0, 0.0, 0.0]))
    assert ix.draft(np.array([1, 2, 3]), 3, branch="reward", min_token_prob=0).tolist() == [4]
    assert ix.draft(np.array([1, 2, 3]), 3, branch="count", min_token_prob=0).tolist() == [5]
    # min_token_prob: 4 has probability 1/3 < 0.5 -> nothing drafted.
    assert ix.draft(np.array([1, 2, 3]), 3, branch="reward", min_token_prob=0.5).tolist() == []
    # A continuation seen only in the plain prompt ranks below one seen in a response.
    ix = SuffixIndex.build(np.array([1, 2, 3, 8, 1, 2, 3, 8, 0, 0, 0, 0, 0]), [np.array([1, 2, 3, 4])],
                           np.array([0.0]))
    assert ix.draft(np.array([1, 2, 3]), 1, branch="reward", min_token_prob=0).tolist() == [4]
    assert ix.draft(np.array([1, 2, 3]), 1, branch="count", min_token_prob=0).tolist() == [8]
    # Shorter than pattern_min: no draft, even though the suffix occurs.
    assert ix.draft(np.array([-1, 2, 3]), 4, branch="count", min_token_prob=0).size == 0


def test_pack_of_several_indexes_matches_each_index():
    rng = np.random.default_rng(7)
    hist = [_random_history(rng, 4) for _ in range(5)]
    indexes = [SuffixIndex.build(*h) for h in hist]
    pack = IndexPack.of(indexes)
    tails, slots, want = [], [], []
    for i, h in enumerate(hist):
        for t in _tails(rng, _strings(*h), 4, 5):
            tails.append(np.concatenate([np.full(12 - t.size, -1, np.int32), t]))
            slots.append(i)
            want.append(indexes[i].draft(t, 6, branch="reward", min_token_prob=0.1))
    slots[0] = -1
    want[0] = np.zeros(0, np.int32)
    out, lens = draft_batch(pack, np.array(slots), np.stack(tails), np.full(len(slots), 6),
                            branch="reward", min_token_prob=0.1)
    assert [out[b, :lens[b]].tolist() for b in range(len(slots))] == [w.tolist() for w in want]
    assert np.all(out[np.arange(out.shape[1]) >= lens[:, None]] == 0)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="responses\\[1\\]"):
        SuffixIndex.build(np.array([1]), [np.array([1]), np.array([-1])], np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="rewards"):
        SuffixIndex.build(np.array([1]), [np.array([1])], np.array([0.0, 1.0]))
    ix = SuffixIndex.build(np.array([1, 2, 3]), [], np.zeros(0))
    with pytest.raises(ValueError, match="branch"):
        ix.draft(np.array([1, 2, 3]), 2, branch="best", min_token_prob=0.1)
    with pytest.raises(ValueError, match="pattern_min"):
        ix.draft(np.array([1, 2, 3]), 2, branch="count", min_token_prob=0.1, pattern_min=8)
    with pytest.raises(ValueError, match="min_token_prob"):
        ix.draft(np.array([1, 2, 3]), 2, branch="count", min_token_prob=1.5)
