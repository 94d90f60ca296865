"""History candidates of goodput drafting: one greedy walk per match length, scored.

For ``spec.window = "goodput"`` (RhymeRL arXiv 2508.18588 s.4 HistoSpec, generalised). The longest
suffix of the running sequence that occurs in the prompt's suffix index (at most ``pattern_max``
tokens) sits in automaton state v; the suffix-link chain ``v, link[v], link[link[v]], ...`` holds
every shorter match, one state per distinct set of occurrences (all match lengths inside one
state continue alike). From each state whose match is at least ``pattern_min`` tokens a greedy
walk drafts: at every step the best child by the configured branch rule (``reward`` or
``count``, as ``sam_kernels._better``; precomputed per state by ``sam_kernels.best_children``)
among the non-terminator children (a separator or the
prompt's end marker is never drafted, but its occurrences count in the denominator), with raw
probability ``q = count(child) / count(parent)``; the running product of q still stops the walk
below ``min_token_prob``. Each token's acceptance estimate is its calibration cell's
(``calibration.py``: source history, match length, depth, q, whether the match
occurred once). A candidate's score is its expected
accepted length ``sum_j prod_{i <= j} est_i`` (SuffixDecoding, Oliaro et al. 2024, arXiv
2411.04975); the row keeps the best (ties: the longer match).

This subsumes the prompt-head fallback: at the start of a response the whole tail matches only
the plain prompt string (continuation END, no draft), but its 5-token suffix also occurs as the
prompt head stored before every response, whose walk drafts the responses' first tokens.

A walk also stops when its cumulative estimate falls below ``MIN_CUM`` (the rest adds under 1%
of a token per position) or when even perfect remaining tokens (each at the table's largest
estimate) could not beat the best candidate so far (exact pruning).

The kernels take their state as small records (``HistoryTables``, ``IndexView``, ``DraftRows``,
``Candidates``, ``Draft``, ``Scoring``; the settings as ``sam_kernels.DraftRule``, the
calibration as ``calibration.Estimates``), which numba passes as plain structs.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from rhyme_jax.spec import calibration as C
from rhyme_jax.spec import sam_kernels as K

MAX_DRAFT = C.MAX_DEPTH  # longest candidate (the engine's shapes.MAX_DRAFT)
MIN_CUM = 0.01  # stop a walk once the probability that all its tokens are accepted falls below


@numba.njit(cache=True, nogil=True)
def tail_bounds(top, out):
    """``out[r] = sum_{t=1..r} top^t``: the most a walk can still gain with r tokens left after
    a prefix whose cumulative estimate is 1 (``top`` = the largest cell estimate)."""
    out[0] = 0.0
    p = 1.0
    for r in range(1, out.shape[0]):
        p *= top
        out[r] = out[r - 1] + p


LENGTH, LINK, COUNT, CHILD, TOKEN = range(5)  # columns of a compact state table


class HistoryTables(NamedTuple):
    """The history indexes of one rollout batch as flat tables (``HistoryPack``): index i's states
    are rows ``so[i]:so[i+1]`` of ``states``, its transition hash rows ``ho[i]:ho[i+1]`` of
    ``trans`` (``compact``)."""

    so: np.ndarray  # int64[N + 1] first state row of each index
    ho: np.ndarray  # int64[N + 1] first hash row of each index
    states: np.ndarray  # int32[S, 5] (length, link, count, best child, its token) per state
    trans: np.ndarray  # int64[H, 2] (key state << 32 | token (-1 empty), target state) per slot


class IndexView(NamedTuple):
    """One index inside a ``HistoryTables``: its state rows start at ``s0``, its transition hash
    has ``mask + 1`` rows from ``h0`` (state ids are local to the index)."""

    states: np.ndarray  # int32[S, 5] all indexes' states
    s0: int
    trans: np.ndarray  # int64[H, 2] all indexes' transition hashes
    h0: int
    mask: int  # int64: hash rows of this index - 1 (a power of two - 1)


class DraftRows(NamedTuple):
    """The rows one draft step asks for."""

    reqs: np.ndarray  # int64[B] request of each row
    tails: np.ndarray  # int32[B, W] last tokens of each row, left-padded with -1
    budgets: np.ndarray  # int64[B] most draft tokens per row (capped at MAX_DRAFT)


class Draft(NamedTuple):
    """One candidate's tokens, per-token acceptance estimates and calibration cells (views or
    scratch of ``MAX_DRAFT`` entries)."""

    tokens: np.ndarray  # int32[K]
    est: np.ndarray  # float32[K]
    cell: np.ndarray  # int32[K]


class Candidates(NamedTuple):
    """The best candidate of each of B rows so far; ``lens[b]`` tokens of row b are valid."""

    tokens: np.ndarray  # int32[B, K] draft tokens
    est: np.ndarray  # float32[B, K] acceptance estimate of each token
    cell: np.ndarray  # int32[B, K] calibration cell of each token
    lens: np.ndarray  # int32[B] tokens drafted
    score: np.ndarray  # float64[B] expected accepted tokens (0 for an empty draft)


class Scoring(NamedTuple):
    """What a walk scores with: the calibration's estimate per cell and the pruning bounds."""

    table: np.ndarray  # float64[C] estimate of each calibration cell
    ub: np.ndarray  # float64[MAX_DRAFT + 1] ``tail_bounds`` of the table's largest estimate


@numba.njit(cache=True, nogil=True)
def compact(length, link, cnt, cptr, ctok, cto, child, token):
    """One index as two cache-friendly tables: ``states int32[S, 5]`` (length, link, count, best
    child, its token) and the transition hash ``trans int64[H, 2]`` (key ``state << 32 | token``,
    -1 empty; target state), H a power of two >= 2E + 2, linear probing with
    ``sam_kernels._hash``: a lookup touches one cache line instead of four arrays."""
    size = length.shape[0]
    states = np.empty((size, 5), np.int32)
    for v in range(size):
        states[v, LENGTH] = length[v]
        states[v, LINK] = link[v]
        states[v, COUNT] = cnt[v]
        states[v, CHILD] = child[v]
        states[v, TOKEN] = token[v]
    h = 1
    while h < 2 * ctok.shape[0] + 2:
        h *= 2
    trans = np.full((h, 2), -1, np.int64)
    mask = np.int64(h - 1)
    for v in range(size):
        for k in range(cptr[v], cptr[v + 1]):
            i = K._hash(v, ctok[k], mask)
            while trans[i, 0] != -1:
                i = (i + 1) & mask
            trans[i, 0] = K._key(v, ctok[k])
            trans[i, 1] = cto[k]
    return states, trans


@numba.njit(cache=True, nogil=True, inline="always")
def _step(ix, v, c):
    """Target of transition (v, c) in the hash of index ``ix`` (``IndexView``), or -1."""
    key = K._key(v, c)
    i = K._hash(v, c, ix.mask)
    while True:
        k = ix.trans[ix.h0 + i, 0]
        if k == key:
            return ix.trans[ix.h0 + i, 1]
        if k == -1:
            return -1
        i = (i + 1) & ix.mask


@numba.njit(cache=True, nogil=True, inline="always")
def _advance(ix, v, m, c, pmax):
    """Matching statistics, one token on: from the longest match (state v, m tokens) of a
    sequence in index ``ix``, that of the sequence + c, capped at ``pmax`` tokens (the cap moves
    v up the suffix links to the state holding the ``pmax``-token suffix)."""
    states, s0 = ix.states, ix.s0
    t = _step(ix, v, c)
    while v != 0 and t == -1:
        v = states[s0 + v, LINK]
        m = states[s0 + v, LENGTH]
        t = _step(ix, v, c)
    if t == -1:
        return 0, 0
    v = t
    m += 1
    if m > pmax:
        m = pmax
        while states[s0 + states[s0 + v, LINK], LENGTH] >= pmax:
            v = states[s0 + v, LINK]
    return v, m


@numba.njit(cache=True, nogil=True, inline="always")
def _match(ix, tail, pmax):
    """``sam_kernels.match_tail`` over the compact tables of index ``ix`` (``IndexView``)."""
    P = tail.shape[0]
    start = K.tail_start(tail, pmax)
    v = 0
    m = 0
    for k in range(start, P):
        v, m = _advance(ix, v, m, tail[k], pmax)
    return v, m


@numba.njit(cache=True, nogil=True, inline="always")
def _window_hash(tail, end, pmax):
    """Hash of the tokens of ``tail[end - pmax:end]`` after its last negative (the window a
    match reads)."""
    h = np.int64(0x2545F4914F6CDD1D)
    for k in range(max(end - pmax, 0), end):
        t = tail[k]
        if t < 0:
            h = np.int64(0x2545F4914F6CDD1D)
        else:
            h = (h ^ np.int64(t)) * np.int64(0x100000001B3)
            h ^= h >> np.int64(29)
    return h


@numba.njit(cache=True, nogil=True, inline="always")
def _match_since(ix, tail, pmax, g, memo):
    """The longest match of ``tail`` in index ``ix`` (``IndexView``): advanced over its last g
    tokens from the previous step's match ``memo = (state, length, window hash)`` when the tail
    is that step's plus g tokens (g from ``observe``; checked by the hash of the window before
    them), else matched afresh. Updates ``memo``."""
    w = tail.shape[0]
    if (memo[0] >= 0 and 0 < g <= pmax and tail[w - g] >= 0 and _window_hash(tail, w - g, pmax) == memo[2]):
        v, m = memo[0], memo[1]
        for k in range(w - g, w):
            v, m = _advance(ix, v, m, tail[k], pmax)
    else:
        v, m = _match(ix, tail, pmax)
    memo[0], memo[1], memo[2] = v, m, _window_hash(tail, w, pmax)
    return v, m


class HistoryPack:
    """The history indexes of one rollout batch in one pair of flat tables (``compact``; one
    numba call takes them without per-index boxing): index i's states are rows
    ``so[i]:so[i+1]`` of ``states`` and its transition hash rows ``ho[i]:ho[i+1]`` of ``trans``.
    Built once per batch: an O(total index size) copy of each index's cached compact tables
    (``SuffixIndex.compact``).

    Args:
      indexes: the batch's ``SuffixIndex`` objects (slot i = ``indexes[i]``).
      branch: ``"reward"`` | ``"count"`` (the best child followed by walks).

    Attributes:
      so, ho, states, trans: as in ``HistoryTables``; ``tables`` holds the four (what
        ``history_candidates`` takes).
    """

    def __init__(self, indexes: list, branch: str):
        tables = [ix.compact(branch) for ix in indexes]
        self.so = np.r_[0, np.cumsum([t[0].shape[0] for t in tables])].astype(np.int64)
        self.ho = np.r_[0, np.cumsum([t[1].shape[0] for t in tables])].astype(np.int64)
        self.states = np.concatenate([t[0] for t in tables]) if tables else np.zeros((0, 5), np.int32)
        self.trans = np.concatenate([t[1] for t in tables]) if tables else np.zeros((0, 2), np.int64)
        self.tables = HistoryTables(self.so, self.ho, self.states, self.trans)


@numba.njit(cache=True, nogil=True, inline="always")
def walk(ix, v, m, max_len, min_prob, scoring, best, draft):
    """Greedy walk from state v (match length m) of index ``ix`` (``IndexView``), at most
    ``max_len`` tokens into ``draft`` (``Draft``), stopping below ``min_prob``; estimates from
    ``scoring`` (``Scoring``). Returns ``(n, score)``; score -1 when pruned (cannot beat
    ``best``)."""
    states, s0, table, ub = ix.states, ix.s0, scoring.table, scoring.ub
    tok, est, cell = draft
    prob = 1.0
    cum = 1.0
    score = 0.0
    n = 0
    while n < max_len:
        nxt = states[s0 + v, CHILD]
        if nxt == -1:
            break
        q = states[s0 + nxt, COUNT] / states[s0 + v, COUNT]
        if prob * q < min_prob:
            break
        prob *= q
        cl = C.cell_of(C.HISTORY, m, n, q, states[s0 + v, COUNT] == 1)
        e = table[cl]
        cum *= e
        score += cum
        tok[n] = states[s0 + v, TOKEN]
        est[n] = e
        cell[n] = cl
        n += 1
        v = nxt
        if cum < MIN_CUM:
            break
        if score + cum * ub[max_len - n] <= best:
            return n, -1.0
    return n, score


@numba.njit(cache=True, nogil=True)
def _best_walk(ix, v, m, max_len, rule, scoring, scratch, out):
    """Best history candidate of one row whose longest match is state v (m tokens) of index
    ``ix``: a ``walk`` (into ``scratch``) from every state of v's suffix-link chain whose match is
    at least ``rule.pmin`` tokens, the best copied into ``out`` (both ``Draft``). Returns
    ``(n, score)``."""
    states, s0 = ix.states, ix.s0
    n_best = 0
    s_best = 0.0
    while v != 0 and m >= rule.pmin:
        n, s = walk(ix, v, m, max_len, rule.min_prob, scoring, s_best, scratch)
        if s > s_best:
            s_best = s
            n_best = n
            for j in range(n):
                out.tokens[j] = scratch.tokens[j]
                out.est[j] = scratch.est[j]
                out.cell[j] = scratch.cell[j]
        v = states[s0 + v, LINK]
        m = states[s0 + v, LENGTH]
    return n_best, s_best


@numba.njit(cache=True, nogil=True)
def history_candidates(hist, slots, rows, grow, memo, rule, cal, best):
    """Best history candidate of B rows into ``best`` (``Candidates``, every row overwritten).

    ``hist`` is a ``HistoryTables``; row b of ``rows`` (``DraftRows``: request ``reqs[b]``,
    ``tails[b]``, ``budgets[b]``) uses index ``slots[b]`` (-1: none) and drafts at most
    ``min(budgets[b], 32)`` tokens by ``rule`` (``sam_kernels.DraftRule``; its branch is already
    in the tables); its request's tail grew by ``grow[r]`` tokens since its last draft (-1
    unknown) and ``memo int64[R, 3]`` holds its last match (-1 none; updated). ``cal`` is a
    ``calibration.Estimates``. ``best.score[b]``: expected accepted tokens (0 for an empty
    draft)."""
    ub = np.zeros(MAX_DRAFT + 1, np.float64)
    tail_bounds(cal.top, ub)
    scoring = Scoring(cal.table, ub)
    scratch = Draft(np.zeros(MAX_DRAFT, np.int32), np.zeros(MAX_DRAFT, np.float32), np.zeros(MAX_DRAFT, np.int32))
    for b in range(rows.tails.shape[0]):
        best.lens[b] = 0
        best.score[b] = 0.0
        i = slots[b]
        ml = min(rows.budgets[b], MAX_DRAFT)
        if i < 0 or ml <= 0:
            continue
        h0 = hist.ho[i]
        r = rows.reqs[b]
        ix = IndexView(hist.states, hist.so[i], hist.trans, h0, np.int64(hist.ho[i + 1] - h0 - 1))
        v, m = _match_since(ix, rows.tails[b], rule.pmax, grow[r], memo[r])
        n, s = _best_walk(ix, v, m, ml, rule, scoring, scratch, Draft(best.tokens[b], best.est[b], best.cell[b]))
        best.lens[b] = n
        best.score[b] = s
