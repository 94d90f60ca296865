"""numba kernels of the HistoSpec suffix index: suffix-automaton build, lookup and draft walk.

The index of one prompt is a suffix automaton (Blumer et al. 1985; the O(n) online construction)
over one text: the indexed strings concatenated, each ending in a negative terminator. Patterns
and drafts hold only token ids >= 0, so a pattern occurrence never crosses a terminator and the
automaton's occurrence counts are exactly the counts over the separate strings.

Flat arrays per index (states 0..S-1, root 0; edges 0..E-1; all int32 except ``rsum``):

* ``length[S]`` longest string of the state; ``link[S]`` suffix link (root: -1);
* ``cnt[S]`` occurrences (= end positions) of the state's strings in all strings; ``rcnt[S]``
  those inside response strings; ``rsum f64[S]`` sum of the rewards of the responses of those
  occurrences;
* children in CSR: edges ``cptr[v]..cptr[v+1]`` of state v have tokens ``ctok[E]`` and targets
  ``cto[E]``;
* transition lookup: open-addressing hash ``htab[H]`` of edge ids (-1 empty; H a power of two
  >= 2E; linear probing; an edge e matches (v, c) when ``cptr[v] <= e < cptr[v+1]`` and
  ``ctok[e] == c``): O(1) expected per pattern token.

Memory: about 60-100 bytes per indexed token. The kernels take one index's arrays as a
``SamArrays`` record; the batched entry point takes a ``SamArrays`` of numba typed lists (one list
per field, one item per index), so a batch of indexes is never copied. The draft settings travel
as one ``DraftRule``.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

BRANCH_REWARD = 0
BRANCH_COUNT = 1


class SamArrays(NamedTuple):
    """The flat arrays of one index (module docstring; S states, E edges, H hash slots), or, for
    ``draft_batch``, one numba typed list per field (item i = index i's array)."""

    length: np.ndarray  # int32[S] longest string of each state
    link: np.ndarray  # int32[S] suffix link (root: -1)
    cnt: np.ndarray  # int32[S] occurrences in all strings
    rcnt: np.ndarray  # int32[S] occurrences inside response strings
    rsum: np.ndarray  # float64[S] sum of the rewards of those responses
    cptr: np.ndarray  # int32[S + 1] CSR offsets of each state's children
    ctok: np.ndarray  # int32[E] child token
    cto: np.ndarray  # int32[E] child state
    htab: np.ndarray  # int32[H] transition hash of edge ids (-1 empty)


class DraftRule(NamedTuple):
    """The HistoSpec draft settings (``suffix_index.check_draft_args`` validates them)."""

    branch: int  # BRANCH_REWARD | BRANCH_COUNT: which child a draft follows (``_better``)
    min_prob: float  # stop once the product of branch probabilities would fall below this
    pmax: int  # longest tail suffix matched, tokens
    pmin: int  # shortest match that drafts, tokens


class _BuildEdges(NamedTuple):
    """Edge arrays of the automaton under construction (``_automaton``)."""

    hk: np.ndarray  # int64[Hb] (state, token) key per hash slot (-1 empty)
    hv: np.ndarray  # int32[Hb] edge id per hash slot
    e_tok: np.ndarray  # int32[Eb] edge token
    e_to: np.ndarray  # int32[Eb] edge target state
    e_from: np.ndarray  # int32[Eb] edge source state
    e_next: np.ndarray  # int32[Eb] next edge of the same source state (-1: last)
    head: np.ndarray  # int32[Sb] first edge of each state (-1: none)


@numba.njit(cache=True, nogil=True, inline="always")
def _hash(state, tok, mask):
    h = np.int64(state) * np.int64(0x9E3779B1) + np.int64(tok) * np.int64(0x85EBCA77)
    h ^= h >> np.int64(29)
    return h & mask


@numba.njit(cache=True, nogil=True, inline="always")
def _key(state, tok):
    return (np.int64(state) << np.int64(32)) | (np.int64(tok) & np.int64(0xFFFFFFFF))


@numba.njit(cache=True, nogil=True)
def _find_slot(hkeys, mask, state, tok):
    """Build-time hash of (state, tok) keys: the key's slot, or the empty slot to fill."""
    key = _key(state, tok)
    h = _hash(state, tok, mask)
    while True:
        k = hkeys[h]
        if k == key or k == -1:
            return h
        h = (h + 1) & mask


@numba.njit(cache=True, nogil=True)
def lookup(cptr, ctok, cto, htab, state, tok):
    """Target state of the transition (state, tok) of one index, or -1."""
    mask = np.int64(htab.shape[0] - 1)
    h = _hash(state, tok, mask)
    while True:
        e = htab[h]
        if e == -1:
            return -1
        if cptr[state] <= e < cptr[state + 1] and ctok[e] == tok:
            return cto[e]
        h = (h + 1) & mask


@numba.njit(cache=True, nogil=True, inline="always")
def _add_edge(edges, ne, s, v, c, to):
    """Build-time edge ``ne``: transition (v, c) -> ``to``, entered in the (state, token) hash
    of ``edges`` (a ``_BuildEdges``) at its empty slot ``s`` (``_find_slot``) and at the head of
    v's edge list. Returns the next edge id."""
    edges.hk[s] = _key(v, c)
    edges.hv[s] = ne
    edges.e_tok[ne] = c
    edges.e_to[ne] = to
    edges.e_from[ne] = v
    edges.e_next[ne] = edges.head[v]
    edges.head[v] = ne
    return ne + 1


@numba.njit(cache=True, nogil=True)
def _automaton(text, pos_reward, pos_resp):
    """The online suffix-automaton construction over ``text``, with each position's own
    occurrence (``cnt``, ``rcnt``, ``rsum`` of the state it creates; not yet summed up the link
    tree). Returns ``(length, link, cnt, rcnt, rsum, e_tok, e_to, e_from, size, ne)``: state
    arrays of capacity ``2n + 2`` (``size`` used) and edge arrays of capacity ``3n + 4`` (``ne``
    used; ``e_from`` = source state)."""
    n = text.shape[0]
    max_states = 2 * n + 2
    max_edges = 3 * n + 4
    length = np.zeros(max_states, np.int32)
    link = np.full(max_states, -1, np.int32)
    head = np.full(max_states, -1, np.int32)  # per-state edge list (for cloning)
    e_next = np.full(max_edges, -1, np.int32)
    e_tok = np.zeros(max_edges, np.int32)
    e_to = np.zeros(max_edges, np.int32)
    e_from = np.zeros(max_edges, np.int32)
    hsize = 1
    while hsize < 2 * max_edges:
        hsize *= 2
    mask = np.int64(hsize - 1)
    hk = np.full(hsize, -1, np.int64)
    hv = np.full(hsize, -1, np.int32)  # edge index during the build
    cnt = np.zeros(max_states, np.int32)
    rcnt = np.zeros(max_states, np.int32)
    rsum = np.zeros(max_states, np.float64)
    edges = _BuildEdges(hk, hv, e_tok, e_to, e_from, e_next, head)
    size = 1
    last = 0
    ne = 0
    for i in range(n):
        c = text[i]
        cur = size
        size += 1
        length[cur] = length[last] + 1
        cnt[cur] = 1
        if pos_resp[i]:
            rcnt[cur] = 1
            rsum[cur] = pos_reward[i]
        p = last
        while p != -1:
            s = _find_slot(hk, mask, p, c)
            if hk[s] != -1:
                break
            ne = _add_edge(edges, ne, s, p, c, cur)
            p = link[p]
        if p == -1:
            link[cur] = 0
        else:
            q = e_to[hv[_find_slot(hk, mask, p, c)]]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # clone q: same edges, length of p + 1; redirect p's suffix chain to it
                clone = size
                size += 1
                length[clone] = length[p] + 1
                link[clone] = link[q]
                e = head[q]
                while e != -1:
                    s = _find_slot(hk, mask, clone, e_tok[e])
                    ne = _add_edge(edges, ne, s, clone, e_tok[e], e_to[e])
                    e = e_next[e]
                while p != -1:
                    s = _find_slot(hk, mask, p, c)
                    if hk[s] == -1 or e_to[hv[s]] != q:
                        break
                    e_to[hv[s]] = clone
                    p = link[p]
                link[q] = clone
                link[cur] = clone
        last = cur
    return length, link, cnt, rcnt, rsum, e_tok, e_to, e_from, size, ne


@numba.njit(cache=True, nogil=True)
def _sum_occurrences(length, link, cnt, rcnt, rsum, size, n):
    """End positions flow up the suffix-link tree, longest states first (a counting sort by
    length): afterwards each state's ``cnt``/``rcnt``/``rsum`` cover all its occurrences."""
    by_len = np.zeros(n + 2, np.int64)
    for v in range(size):
        by_len[length[v]] += 1
    for k in range(1, n + 2):
        by_len[k] += by_len[k - 1]
    order = np.empty(size, np.int32)
    for v in range(size - 1, -1, -1):
        by_len[length[v]] -= 1
        order[by_len[length[v]]] = v
    for k in range(size - 1, 0, -1):
        v = order[k]
        u = link[v]
        cnt[u] += cnt[v]
        rcnt[u] += rcnt[v]
        rsum[u] += rsum[v]


@numba.njit(cache=True, nogil=True)
def _children(e_tok, e_to, e_from, size, ne):
    """The ``ne`` build edges as CSR children ``(cptr[size + 1], ctok[ne], cto[ne])`` (build
    order within a state) and the compact open-addressing hash ``htab`` of their edge ids."""
    cptr = np.zeros(size + 1, np.int32)
    for e in range(ne):
        cptr[e_from[e] + 1] += 1
    for v in range(size):
        cptr[v + 1] += cptr[v]
    fill = cptr[:-1].copy()
    ctok = np.empty(ne, np.int32)
    cto = np.empty(ne, np.int32)
    for e in range(ne):
        k = fill[e_from[e]]
        fill[e_from[e]] += 1
        ctok[k] = e_tok[e]
        cto[k] = e_to[e]
    hsize = 1
    while hsize < 2 * ne + 2:
        hsize *= 2
    mask = np.int64(hsize - 1)
    htab = np.full(hsize, -1, np.int32)
    for v in range(size):
        for k in range(cptr[v], cptr[v + 1]):
            h = _hash(v, ctok[k], mask)
            while htab[h] != -1:
                h = (h + 1) & mask
            htab[h] = k
    return cptr, ctok, cto, htab


@numba.njit(cache=True, nogil=True)
def build_sam(text, pos_reward, pos_resp):
    """Suffix automaton of ``text`` (int32[n], n >= 1) with per-state statistics.

    Args:
      text: int32[n] the concatenated strings (terminators are negative).
      pos_reward: float64[n] reward of the response string holding each position (0 elsewhere).
      pos_resp: int8[n] 1 where the position lies in a response string.

    Returns:
      (length, link, cnt, rcnt, rsum, cptr, ctok, cto, htab) as described in the module
      docstring.
    """
    length, link, cnt, rcnt, rsum, e_tok, e_to, e_from, size, ne = _automaton(text, pos_reward, pos_resp)
    _sum_occurrences(length, link, cnt, rcnt, rsum, size, text.shape[0])
    cptr, ctok, cto, htab = _children(e_tok, e_to, e_from, size, ne)
    return (length[:size].copy(), link[:size].copy(), cnt[:size].copy(), rcnt[:size].copy(),
            rsum[:size].copy(), cptr, ctok, cto, htab)


@numba.njit(cache=True, nogil=True)
def _better(branch, child, best):
    """Branch rule: is ``child`` preferred to the ``best`` so far? Both are ``(has response
    occurrences, mean reward, count, token)``.

    reward: children with response occurrences first, then higher mean reward, higher count,
    smaller token id. count: higher count, then smaller token id."""
    hr, mean, c, tok = child
    bhr, bmean, bc, btok = best
    if branch == BRANCH_REWARD:
        if hr != bhr:
            return hr > bhr
        if hr and mean != bmean:
            return mean > bmean
    if c != bc:
        return c > bc
    return tok < btok


@numba.njit(cache=True, nogil=True, inline="always")
def tail_start(tail, pmax):
    """First index of the tokens a match uses: the last ``pmax`` of ``tail``, after its last
    negative (padding) entry."""
    P = tail.shape[0]
    start = P - pmax if P > pmax else 0
    for k in range(P - 1, start - 1, -1):
        if tail[k] < 0:
            return k + 1
    return start


@numba.njit(cache=True, nogil=True)
def match_tail(ix, tail, pmax):
    """Longest suffix of ``tail`` (its last ``pmax`` tokens after the last negative one) that
    occurs in the index ``ix`` (``SamArrays``; matching statistics over the automaton):
    ``(state, match length)``, ``(0, 0)`` when not even the last token occurs."""
    P = tail.shape[0]
    start = tail_start(tail, pmax)
    v = 0
    m = 0
    for k in range(start, P):
        c = tail[k]
        while v != 0 and lookup(ix.cptr, ix.ctok, ix.cto, ix.htab, v, c) == -1:
            v = ix.link[v]
            m = ix.length[v]
        t = lookup(ix.cptr, ix.ctok, ix.cto, ix.htab, v, c)
        if t != -1:
            v = t
            m += 1
        else:
            v = 0
            m = 0
    return v, m


@numba.njit(cache=True, nogil=True)
def draft_one(ix, tail, max_len, rule, out):
    """Draft of one sequence from one index ``ix`` (``SamArrays``) by ``rule`` (``DraftRule``).

    ``tail``: the running sequence's last tokens (negative = padding; only tokens after the last
    negative are used, at most ``rule.pmax``). Writes at most ``max_len`` draft tokens into
    ``out[:n]`` and returns n.
    """
    cnt, rcnt, rsum, cptr, ctok, cto = ix.cnt, ix.rcnt, ix.rsum, ix.cptr, ix.ctok, ix.cto
    v, m = match_tail(ix, tail, rule.pmax)
    if m < rule.pmin or m == 0:
        return 0
    prob = 1.0
    n = 0
    while n < max_len:
        best = -1
        bhr = False
        bmean = 0.0
        bc = np.int32(0)
        btok = 0
        for k in range(cptr[v], cptr[v + 1]):
            t = cto[k]
            c = cnt[t]
            rc = rcnt[t]
            hr = rc > 0
            mean = rsum[t] / rc if hr else 0.0
            if best == -1 or _better(rule.branch, (hr, mean, c, ctok[k]), (bhr, bmean, bc, btok)):
                best = t
                bhr = hr
                bmean = mean
                bc = c
                btok = ctok[k]
        if best == -1 or btok < 0:
            break
        p = prob * (bc / cnt[v])
        if p < rule.min_prob:
            break
        prob = p
        out[n] = btok
        n += 1
        v = best
    return n


@numba.njit(cache=True, nogil=True)
def draft_batch(pack, slots, tails, max_lens, rule, out, lens):
    """Drafts of B sequences by ``rule`` (``DraftRule``). ``pack`` is a ``SamArrays`` of typed
    lists (item i = index i's array); row b drafts from index ``slots[b]`` (-1: none) at most
    ``max_lens[b]`` tokens of ``tails[b]`` into ``out[b]`` and writes its length to ``lens[b]``."""
    for b in range(tails.shape[0]):
        i = slots[b]
        if i < 0 or max_lens[b] <= 0:
            lens[b] = 0
            continue
        ix = SamArrays(pack.length[i], pack.link[i], pack.cnt[i], pack.rcnt[i], pack.rsum[i], pack.cptr[i],
                       pack.ctok[i], pack.cto[i], pack.htab[i])
        lens[b] = draft_one(ix, tails[b], max_lens[b], rule, out[b])


@numba.njit(cache=True, nogil=True)
def best_children(cnt, rcnt, rsum, cptr, ctok, cto, branch):
    """Per state, its best child by the branch rule (``_better``) among the children whose token
    is not a terminator: ``(child int32[S], token int32[S])``, child -1 where there is none.
    O(E); what the goodput walk follows instead of scanning children at every step."""
    size = cptr.shape[0] - 1
    child = np.full(size, -1, np.int32)
    token = np.full(size, -1, np.int32)
    for v in range(size):
        best = -1
        bhr = False
        bmean = 0.0
        bc = np.int32(0)
        btok = np.int32(0)
        for k in range(cptr[v], cptr[v + 1]):
            if ctok[k] < 0:
                continue
            t = cto[k]
            c = cnt[t]
            rc = rcnt[t]
            hr = rc > 0
            mean = rsum[t] / rc if hr else 0.0
            if best == -1 or _better(branch, (hr, mean, c, ctok[k]), (bhr, bmean, bc, btok)):
                best, bhr, bmean, bc, btok = t, hr, mean, c, ctok[k]
        child[v] = best
        token[v] = btok if best != -1 else -1
    return child, token
