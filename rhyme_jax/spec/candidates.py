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
(``calibration.py``: source history, match length, depth, q). A candidate's score is its expected
accepted length ``sum_j prod_{i <= j} est_i`` (SuffixDecoding, Oliaro et al. 2024, arXiv
2411.04975); the row keeps the best (ties: the longer match).

This subsumes the prompt-head fallback: at the start of a response the whole tail matches only
the plain prompt string (continuation END, no draft), but its 5-token suffix also occurs as the
prompt head stored before every response, whose walk drafts the responses' first tokens.

A walk also stops when its cumulative estimate falls below ``MIN_CUM`` (the rest adds under 1%
of a token per position) or when even perfect remaining tokens (each at the table's largest
estimate) could not beat the best candidate so far (exact pruning).
"""

from __future__ import annotations

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


class HistoryPack:
    """The history indexes of one rollout batch as flat arrays (one numba call takes them without
    per-index boxing): index i's states are ``so[i]:so[i+1]`` of ``length, link, cnt, child,
    token`` (its best non-terminator child by the branch rule, ``SuffixIndex.best_children``), its
    ``cptr`` is ``po[i]:po[i+1]``, its edges ``eo[i]:eo[i+1]`` of ``ctok, cto`` and its hash
    ``ho[i]:ho[i+1]`` of ``htab``. Built once per batch: O(total index size) copy.

    Args:
      indexes: the batch's ``SuffixIndex`` objects (slot i = ``indexes[i]``).
      branch: ``"reward"`` | ``"count"``.
    """

    def __init__(self, indexes: list, branch: str):
        def cat(arrs, dtype):
            return np.concatenate([np.asarray(a, dtype) for a in arrs]) if arrs else np.zeros(0, dtype)

        def offs(sizes):
            return np.r_[0, np.cumsum(sizes)].astype(np.int64)

        best = [ix.best_children(branch) for ix in indexes]
        self.so = offs([ix.length.size for ix in indexes])
        self.po = offs([ix.cptr.size for ix in indexes])
        self.eo = offs([ix.ctok.size for ix in indexes])
        self.ho = offs([ix.htab.size for ix in indexes])
        self.arrays = tuple(cat([getattr(ix, f) for ix in indexes], np.int32)
                            for f in ("length", "link", "cnt", "cptr", "ctok", "cto", "htab"))
        self.arrays += (cat([b[0] for b in best], np.int32), cat([b[1] for b in best], np.int32))

    def args(self) -> tuple:
        """The arguments ``history_candidates`` takes first."""
        return (self.so, self.po, self.eo, self.ho) + self.arrays


@numba.njit(cache=True, nogil=True, inline="always")
def walk(cnt, child, token, v, m, max_len, min_prob, table, ub, best, tok, est, cell):
    """Greedy walk from state v (match length m) of at most ``max_len`` tokens into
    ``tok``/``est``/``cell``. Returns ``(n, score)``; score -1 when pruned (cannot beat ``best``)."""
    prob = 1.0
    cum = 1.0
    score = 0.0
    n = 0
    while n < max_len:
        nxt = child[v]
        if nxt == -1:
            break
        q = cnt[nxt] / cnt[v]
        if prob * q < min_prob:
            break
        prob *= q
        cl = C.cell_of(C.HISTORY, m, n, q)
        e = table[cl]
        cum *= e
        score += cum
        tok[n] = token[v]
        est[n] = e
        cell[n] = cl
        n += 1
        v = nxt
        if cum < MIN_CUM:
            break
        if score + cum * ub[max_len - n] <= best:
            return n, -1.0
    return n, score


@numba.njit(cache=True, nogil=True, inline="always")
def _row(length, link, cnt, cptr, ctok, cto, htab, child, token, tail, max_len, min_prob, pmax, pmin, table, ub,
         tok, est, cell, out, out_est, out_cell):
    """Best history candidate of one row into ``out*``; returns ``(n, score)``."""
    v, m = K.match_tail(length, link, cptr, ctok, cto, htab, tail, pmax)
    n_best = 0
    s_best = 0.0
    while v != 0 and m >= pmin:
        n, s = walk(cnt, child, token, v, m, max_len, min_prob, table, ub, s_best, tok, est, cell)
        if s > s_best:
            s_best = s
            n_best = n
            for j in range(n):
                out[j] = tok[j]
                out_est[j] = est[j]
                out_cell[j] = cell[j]
        v = link[v]
        m = length[v]
    return n_best, s_best


@numba.njit(cache=True, nogil=True)
def history_candidates(so, po, eo, ho, length, link, cnt, cptr, ctok, cto, htab, child, token, slots, tails,
                       max_lens, min_prob, pmax, pmin, table, top, out, out_est, out_cell, lens, score):
    """Best history candidate of B rows. The first 13 arguments are a ``HistoryPack``; row b uses
    index ``slots[b]`` (-1: none), drafts at most ``max_lens[b]`` (<= 32) tokens into ``out[b]``
    (int32), their estimates into ``out_est[b]`` (float32) and cells into ``out_cell[b]``
    (int32), and writes ``lens[b]`` and ``score[b]`` (expected accepted tokens; 0 for an empty
    draft). ``table``/``top``: the calibration's estimates and their maximum."""
    ub = np.zeros(MAX_DRAFT + 1, np.float64)
    tail_bounds(top, ub)
    tok = np.zeros(MAX_DRAFT, np.int32)
    est = np.zeros(MAX_DRAFT, np.float32)
    cell = np.zeros(MAX_DRAFT, np.int32)
    for b in range(tails.shape[0]):
        lens[b] = 0
        score[b] = 0.0
        i = slots[b]
        ml = min(max_lens[b], MAX_DRAFT)
        if i < 0 or ml <= 0:
            continue
        s0, s1 = so[i], so[i + 1]
        e0, e1 = eo[i], eo[i + 1]
        n, s = _row(length[s0:s1], link[s0:s1], cnt[s0:s1], cptr[po[i]:po[i + 1]], ctok[e0:e1], cto[e0:e1],
                    htab[ho[i]:ho[i + 1]], child[s0:s1], token[s0:s1], tails[b], ml, min_prob, pmax, pmin, table,
                    ub, tok, est, cell, out[b], out_est[b], out_cell[b])
        lens[b] = n
        score[b] = s
