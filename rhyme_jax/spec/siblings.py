"""Self and sibling candidates of goodput drafting: the batch's own sequences, reconstructed.

For ``spec.window = "goodput"`` with ``spec.self_lookup`` (prompt lookup decoding: the sequence's
own earlier tokens) and/or ``spec.siblings`` (the same step's other responses to the same prompt,
i.e. the GRPO group, running or finished). The drafter never receives responses from the engine,
so ``SequenceStore`` rebuilds each request's sequence (prompt + response) from what it is given:

* the first ``tails`` row of a request (its last ``context_width`` tokens: usually the whole
  prompt plus the first sampled token) starts its sequence;
* each later row holds ``accepted + 1`` new tokens at its end (``observe`` said how many); they
  are appended after checking that the rest of the row lines up with the stored end. A row that
  does not line up (e.g. after a preemption) is aligned by search, or else starts a new segment
  after a separator (-1; no match crosses it).

What is lost: the tokens a request emits in its final pass (it is never drafted again, so a
finished sibling lacks its last ``accepted + 1`` tokens, usually the end of the answer); prompt
tokens before the first row's window; and, after a new segment, matches across it.

Matching (per row, after all rows are extended): the longest suffix of the sequence, between
``pattern_min`` and ``pattern_max`` tokens, that occurred earlier in the sequence itself (self) or
anywhere in a sibling's stored tokens. Occurrences are found through a hash of each position's
``pattern_min``-gram per group: the table maps (group, gram) to the newest occurrence, and each
occurrence links to the previous one, so a query walks at most ``CHAIN_MAX`` occurrences, newest
first, and extends each backwards to ``pattern_max``. Per source (self, siblings), among the
occurrences with the longest match the one whose next token is the most common among them wins
(ties: the newest; prompt lookup's newest occurrence is a worse guess when a pattern recurs:
SuffixDecoding drafts the most frequent continuation); that token's share is the candidate's
raw probability. The continuation after the match is the candidate; each token gets the
calibrated estimate of (source, match length, depth, raw probability) (``calibration.py``) and
the candidate replaces the row's history candidate when its expected accepted length is larger
(SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975, scores candidates the same way).
Cost: O(1) expected per new token and O(CHAIN_MAX * (pattern_max + CHAIN_MAX)) per query.

The kernels take the store as one ``StoreArrays`` record, the step's rows as
``candidates.DraftRows``, the settings as ``sam_kernels.DraftRule`` and ``LookupSources``, and
write into ``candidates.Candidates``.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
from jaxtyping import Int

from rhyme_jax.spec import calibration as C
from rhyme_jax.spec.candidates import MAX_DRAFT, MIN_CUM, Draft

CHAIN_MAX = 16  # occurrences of a gram examined per query (newest first)
ALIGN = 8  # tokens compared when lining a tail up with the stored sequence
_MASK = np.int64(0x3FFFFFFFFFFFFFFF)


class StoreArrays(NamedTuple):
    """A ``SequenceStore``'s arrays (its attributes; ``SequenceStore.arrays``), changed in place
    by the kernels."""

    seq: np.ndarray  # int32[R, cap] stored tokens (-1: segment separator)
    prev: np.ndarray  # int32[R, cap, 2] previous occurrence (request, end) of each position's gram
    slen: np.ndarray  # int64[R] stored tokens per request
    seg: np.ndarray  # int64[R] start of each request's current segment
    grams: np.ndarray  # int64[H, 2] (group, gram) key (-1 empty) and newest occurrence
    used: np.ndarray  # int64[4] table slots in use, then the three alignment counts
    groups: np.ndarray  # int64[R] GRPO group of each request


class LookupSources(NamedTuple):
    """Which lookup sources draft (``spec.self_lookup``, ``spec.siblings``)."""

    self_lookup: bool
    siblings: bool


class Occurrences(NamedTuple):
    """Scratch of ``_query_row``: up to ``CHAIN_MAX`` earlier occurrences of a row's end."""

    req: np.ndarray  # int64[CHAIN_MAX] request holding the occurrence
    end: np.ndarray  # int64[CHAIN_MAX] its end position (exclusive)
    match: np.ndarray  # int64[CHAIN_MAX] tokens it shares with the row's end


@numba.njit(cache=True, nogil=True, inline="always")
def _gram_key(row, e, pmin, group):
    """Hash key (>= 0) of the ``pmin`` tokens ``row[e - pmin:e]`` in ``group``; -1 when one is
    negative (a separator)."""
    h = np.int64(group) * np.int64(0x2545F4914F6CDD1D) + np.int64(0x1F3D5B79)
    for i in range(e - pmin, e):
        t = row[i]
        if t < 0:
            return np.int64(-1)
        h = (h ^ np.int64(t)) * np.int64(0x100000001B3)
        h ^= h >> np.int64(29)
    return h & _MASK


@numba.njit(cache=True, nogil=True, inline="always")
def _slot(table, key):
    """Row of ``key`` in the gram table: where it is, or the empty row to put it in."""
    mask = table.shape[0] - 1
    h = (key ^ (key >> np.int64(23))) & mask
    while table[h, 0] != -1 and table[h, 0] != key:
        h = (h + 1) & mask
    return h


@numba.njit(cache=True, nogil=True, inline="always")
def _insert(store, r, e, pmin):
    """Enter the gram ending at ``seq[r, e - 1]`` into its group's occurrence chain (the table
    row holds the key and the newest occurrence ``request << 32 | end``); grams reaching before
    the current segment are left out. ``store``: a ``StoreArrays``."""
    prev, table, used = store.prev, store.grams, store.used
    prev[r, e - 1, 0] = -1
    if e - pmin < store.seg[r]:
        return
    key = _gram_key(store.seq[r], e, pmin, store.groups[r])
    if key < 0:
        return
    h = _slot(table, key)
    if table[h, 0] == -1:
        if used[0] * 10 >= table.shape[0] * 7:  # full: the gram is left out (the caller regrows)
            return
        table[h, 0] = key
        used[0] += 1
    else:
        prev[r, e - 1, 0] = table[h, 1] >> np.int64(32)
        prev[r, e - 1, 1] = table[h, 1] & np.int64(0xFFFFFFFF)
    table[h, 1] = (np.int64(r) << np.int64(32)) | np.int64(e)


@numba.njit(cache=True, nogil=True, inline="always")
def _lines_up(seq_row, n, seg, tail, lo, t, g):
    """Do the ``t - g`` tokens of ``tail[lo:]`` before its last g line up with the stored end?"""
    c = min(t - g, n - seg, ALIGN)
    if c <= 0:
        return False
    for i in range(c):
        if seq_row[n - c + i] != tail[lo + t - g - c + i]:
            return False
    return True


@numba.njit(cache=True, nogil=True, inline="always")
def _quick_lines_up(seq_row, n, seg, tail, g):
    """The common case without finding the tail's start: the ``ALIGN`` (or fewer, at a segment
    start) tokens before the tail's last g are all tokens and equal the stored end."""
    w = tail.shape[0]
    c = min(n - seg, ALIGN)
    if c <= 0 or g < 0 or w - g - c < 0 or tail[w - g - c] < 0:
        return False
    for i in range(c):
        if seq_row[n - c + i] != tail[w - g - c + i]:
            return False
    return True


@numba.njit(cache=True, nogil=True, inline="always")
def _first_token(tail):
    """First non-padding column of a tail (padding is a left run of negatives)."""
    lo, hi = 0, tail.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        if tail[mid] < 0:
            lo = mid + 1
        else:
            hi = mid
    return lo


@numba.njit(cache=True, nogil=True, inline="always")
def _new_tokens(store, grow, r, tail):
    """How many tokens at the end of request r's ``tail`` are new: ``grow[r]`` when the tail
    lines up with the stored sequence (the common case), else the smallest shift that lines up,
    else the whole tail after a new segment's separator (module docstring). Counts the case in
    ``used[1:]``."""
    seq, prev, slen, seg, used = store.seq, store.prev, store.slen, store.seg, store.used
    n = slen[r]
    if n > 0 and _quick_lines_up(seq[r], n, seg[r], tail, grow[r]):
        used[1] += 1
        return grow[r]
    lo = _first_token(tail)
    t = tail.shape[0] - lo
    if n == 0 or t == 0:
        return t
    for g in range(0, t):
        if _lines_up(seq[r], n, seg[r], tail, lo, t, g):
            used[2] += 1
            return g
    seq[r, n] = -1  # no overlap: a new segment
    prev[r, n, 0] = -1
    slen[r] = seg[r] = n + 1
    used[3] += 1
    return t


@numba.njit(cache=True, nogil=True, inline="always")
def _extend_row(store, grow, r, tail, pmin):
    """Append the new tokens of request r's ``tail`` to ``store`` and index their grams."""
    w = tail.shape[0]
    g = _new_tokens(store, grow, r, tail)
    n = store.slen[r]
    for i in range(w - g, w):
        store.seq[r, n] = tail[i]
        n += 1
        _insert(store, r, n, pmin)
    store.slen[r] = n


@numba.njit(cache=True, nogil=True, inline="always")
def _back_match(seq, s, e, r, n, pmax):
    """Tokens (<= pmax) that ``seq[s, :e]`` and ``seq[r, :n]`` share at their ends."""
    m = 0
    while m < pmax and e - 1 - m >= 0 and n - 1 - m >= 0:
        a = seq[s, e - 1 - m]
        if a < 0 or a != seq[r, n - 1 - m]:
            break
        m += 1
    return m


@numba.njit(cache=True, nogil=True, inline="always")
def _score_into(seq, span, key, max_len, table, best, out):
    """Candidate ``seq[s, e:stop]`` (``span = (s, e, stop)``; up to a separator / ``max_len``)
    with cells ``calibration.cell_of(source, m, depth, q, once)`` (``key = (source, m, q,
    once)``: match length m, raw probability q, whether the match occurred once): written into
    ``out`` (``Draft``) when its expected accepted length beats ``best``; returns ``(n, score)``
    or ``(-1, best)`` when it does not."""
    s, e, stop = span
    source, m, q, once = key
    cum = 1.0
    score = 0.0
    n = 0
    while n < max_len and e + n < stop and seq[s, e + n] >= 0 and cum >= MIN_CUM:
        cum *= table[C.cell_of(source, m, n, q, once)]
        score += cum
        n += 1
    if score <= best:
        return -1, best
    for j in range(n):
        cl = C.cell_of(source, m, j, q, once)
        out.tokens[j] = seq[s, e + j]
        out.est[j] = table[cl]
        out.cell[j] = cl
    return n, score


@numba.njit(cache=True, nogil=True, inline="always")
def _mode(seq, occ, k, r, own):
    """Among the first k of ``occ`` (``Occurrences``) of request r itself (``own``) or of its
    siblings: the longest match m, one occurrence ``(s, e)`` whose next token is the most common
    among those matching m tokens (ties: the newest), that token's share q and whether one
    occurrence matches. Returns ``(m, s, e, q, once)`` (m = 0: none)."""
    rr, ee, mm = occ
    m = 0
    for i in range(k):
        if (rr[i] == r) == own:
            m = max(m, mm[i])
    tot, best, s, e = 0, 0, 0, 0
    for i in range(k):
        if (rr[i] == r) == own and mm[i] == m:
            tot += 1
            agree = 0
            for j in range(k):
                if (rr[j] == r) == own and mm[j] == m and seq[rr[j], ee[j]] == seq[rr[i], ee[i]]:
                    agree += 1
            if agree > best:
                best, s, e = agree, rr[i], ee[i]
    return m, s, e, best / max(tot, 1), tot == 1


@numba.njit(cache=True, nogil=True, inline="always")
def _query_row(store, r, rule, sources, occ):
    """Earlier matches (>= ``rule.pmin`` tokens, counted up to ``rule.pmax``) of request r's end
    in itself and in its siblings (as ``sources`` allow): the ``CHAIN_MAX`` newest occurrences of
    its last gram at most, into ``occ`` (``Occurrences``). Returns how many."""
    seq, prev, slen, seg, table = store.seq, store.prev, store.slen, store.seg, store.grams
    pmin, pmax, use_self, use_sib = rule.pmin, rule.pmax, sources.self_lookup, sources.siblings
    rr, ee, mm = occ
    n = slen[r]
    k = 0
    if n - seg[r] < pmin:
        return k
    key = _gram_key(seq[r], n, pmin, store.groups[r])
    if key < 0:
        return k
    h = _slot(table, key)
    if table[h, 0] == -1:
        return k
    s, e = table[h, 1] >> np.int64(32), table[h, 1] & np.int64(0xFFFFFFFF)
    for _ in range(CHAIN_MAX):
        if s < 0:
            break
        if (s == r and e < n and use_self) or (s != r and use_sib and e < slen[s]):
            m = _back_match(seq, s, e, r, n, pmax)
            if m >= pmin:
                rr[k], ee[k], mm[k] = s, e, m
                k += 1
        s, e = np.int64(prev[s, e - 1, 0]), np.int64(prev[s, e - 1, 1])
    return k


@numba.njit(cache=True, nogil=True)
def lookup_candidates(store, grow, rows, rule, sources, cal, best):
    """Extend every row's sequence in ``store`` (``StoreArrays``) with its tail (``rows``:
    ``candidates.DraftRows``; ``grow int64[R]`` tokens each request's tail gained, -1 unknown),
    then let its best self / sibling candidate (``sources``: ``LookupSources``; match lengths by
    ``rule``: ``sam_kernels.DraftRule``; estimates from ``cal``: ``calibration.Estimates``)
    replace its history candidate in ``best`` (``candidates.Candidates`` from
    ``history_candidates``) where that scores higher."""
    seq, slen = store.seq, store.slen
    for b in range(rows.reqs.shape[0]):
        _extend_row(store, grow, rows.reqs[b], rows.tails[b], rule.pmin)
    occ = Occurrences(np.zeros(CHAIN_MAX, np.int64), np.zeros(CHAIN_MAX, np.int64), np.zeros(CHAIN_MAX, np.int64))
    for b in range(rows.reqs.shape[0]):
        r = rows.reqs[b]
        ml = min(rows.budgets[b], MAX_DRAFT)
        if ml <= 0:
            continue
        k = _query_row(store, r, rule, sources, occ)
        for source in (C.SELF, C.SIBLING):
            m, s, e, q, once = _mode(seq, occ, k, r, source == C.SELF)
            if m > 0:
                n, sc = _score_into(seq, (s, e, slen[s]), (source, m, q, once), ml, cal.table, best.score[b],
                                    Draft(best.tokens[b], best.est[b], best.cell[b]))
                if n >= 0:
                    best.lens[b], best.score[b] = n, sc


@numba.njit(cache=True, nogil=True)
def room_needed(slen, grow, reqs, tails):
    """``(most tokens a row can hold after the next extension, new grams expected)`` (a tail that
    does not line up may add more; the table then leaves grams out until the next call)."""
    most = 0
    new = 0
    for b in range(reqs.shape[0]):
        r = reqs[b]
        most = max(most, slen[r] + tails.shape[1] + 1)
        if grow[r] >= 0 and slen[r] > 0:
            new += grow[r] + 1
        else:
            new += tails.shape[1] - _first_token(tails[b]) + 1
    return most, new


@numba.njit(cache=True, nogil=True)
def has_room(store, grow, reqs, tails):
    """Whether the next extension of rows ``reqs`` by ``tails`` fits ``store`` (``StoreArrays``)
    as it is (the rule ``SequenceStore.reserve`` grows by: ``room_needed`` tokens per row, the
    gram table at most half full)."""
    most, new = room_needed(store.slen, grow, reqs, tails)
    return most <= store.seq.shape[1] and (store.used[0] + new) * 2 <= store.grams.shape[0]


@numba.njit(cache=True, nogil=True)
def _rehash(grams, new):
    for h in range(grams.shape[0]):
        if grams[h, 0] != -1:
            k = _slot(new, grams[h, 0])
            new[k, 0] = grams[h, 0]
            new[k, 1] = grams[h, 1]


class SequenceStore:
    """The requests' sequences of one rollout batch, rebuilt from their tails, with a gram index
    per GRPO group (module docstring).

    Args:
      groups: ``int[R]`` group of each request (requests with the same prompt share one).
      pattern_min / pattern_max: shortest / longest match, in tokens.

    Attributes:
      seq: ``int32[R, cap]`` stored tokens (-1: segment separator); ``slen int64[R]`` their count;
      seg: ``int64[R]`` start of the current segment;
      prev: ``int32[R, cap, 2]`` previous occurrence (request, end) of the gram ending at each
        position (-1: none); grams ``int64[H, 2]``: key of (group, gram) (-1: empty) and its
        newest occurrence ``request << 32 | end``.
      used: ``int64[4]``: table slots in use, then counts of tails that lined up as ``observe``
        said, that were aligned by search, and that started a new segment.
    """

    def __init__(self, groups: Int[np.ndarray, "R"], pattern_min: int, pattern_max: int, cap: int = 512):
        self.groups = np.ascontiguousarray(groups, np.int64)
        r = self.groups.size
        self.pmin, self.pmax = int(pattern_min), int(pattern_max)
        self.seq = np.full((r, cap), -1, np.int32)
        self.prev = np.full((r, cap, 2), -1, np.int32)
        self.slen = np.zeros(r, np.int64)
        self.seg = np.zeros(r, np.int64)
        self.grams = np.full((1 << 12, 2), -1, np.int64)
        self.used = np.zeros(4, np.int64)

    def reserve(self, reqs: Int[np.ndarray, "B"], tails: Int[np.ndarray, "B W"], grow: Int[np.ndarray, "R"]) -> None:
        """Room for the next extension of rows ``reqs`` (``int64[B]``) by ``tails``
        (``int32[B, W]``; ``grow`` tokens each request's tail gained, -1 unknown): tokens per row
        and table slots for their grams (doubling; a full table leaves grams out, never fails)."""
        need, new = room_needed(self.slen, grow, reqs, tails)
        if need > self.seq.shape[1]:
            cap = max(need, 2 * self.seq.shape[1])
            extra = cap - self.seq.shape[1]
            self.seq = np.pad(self.seq, ((0, 0), (0, extra)), constant_values=-1)
            self.prev = np.pad(self.prev, ((0, 0), (0, extra), (0, 0)), constant_values=-1)
        size = self.grams.shape[0]
        while (self.used[0] + new) * 2 > size:
            size *= 2
        if size > self.grams.shape[0]:
            grams = np.full((size, 2), -1, np.int64)
            _rehash(self.grams, grams)
            self.grams = grams

    def arrays(self) -> StoreArrays:
        """The store's current arrays as one record (what the kernels take; no copy). Take it
        again after ``reserve``, which may replace ``seq``, ``prev`` and ``grams``."""
        return StoreArrays(self.seq, self.prev, self.slen, self.seg, self.grams, self.used, self.groups)

    def sequence(self, r: int) -> np.ndarray:
        """Stored tokens of request r (``int32[n]``; -1 between segments)."""
        return self.seq[r, : self.slen[r]].copy()
