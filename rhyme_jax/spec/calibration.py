"""Online calibration of per-token draft acceptance estimates (``spec.window = "goodput"``).

Each draft token gets a *cell*: (source, match-length bucket, depth bucket, raw-probability
bucket). Sources: ``history`` (the prompt's suffix index; raw probability = the branch share
``count(child) / count(parent)`` of the token), ``self`` (the sequence's own earlier tokens) and
``sibling`` (the same step's other responses to the prompt); for these two lookup sources the raw
probability is the share of the longest match's occurrences that continue with the drafted
occurrence's next token. Raw-probability buckets: ``floor(10 q)`` for ``q < 1``, 10 for ``q = 1``
over several occurrences, 11 for a match that occurred once (``q = 1`` on one example: weak
evidence). The estimate of a token is the posterior mean of its cell's conditional
acceptance (accepted given the earlier draft tokens were) under a two-level Beta model:

* coarse cell (source, raw-probability bucket): ``Beta(S0 * base, S0 * (1 - base))`` with
  ``base = HISTORY_SHRINK * bucket centre`` for history (``AGREE_BASE`` for share 1 over several
  occurrences, ``SINGLE_BASE`` for one occurrence) and ``LOOKUP_BASE`` for self/sibling;
  its posterior mean ``c = (succ_c + S0 * base) / (trials_c + S0)``;
* middle cell (source, match-length bucket, depth bucket): how its tokens fare against their
  coarse means, a factor ``r = (succ_m + S2 * MATCH_PRIOR[match bucket]) / (expected_m + S2)``
  (``expected_m``: the sum of the coarse means its tested tokens had). Its prior factor is below
  1 after 1- to 3-token matches (one-sided branch counts after so short a match are weak
  evidence); the data then learn how match length and draft position shift acceptance, pooled
  over branch shares (far more trials than a fine cell gets);
* fine cell: prior ``Beta(S1 * c', S1 * (1 - c'))`` around ``c' = min(c * r, CAP)``, so a cell
  seen rarely follows what its source, branch share, match length and depth do overall;
  estimate ``(succ_f + S1 * c') / (trials_f + S1)``, strictly inside (0, 1).

The middle level and the one-occurrence bucket came from the SmolLM2 replay at T = 1 against the
suffix-tree peer (``python -m rhyme_lab replay-drafts``, docs/architecture.md s. goodput).

``observe`` feeds the verify outcome of each drafted row: with ``d`` tokens sent and ``a``
accepted, positions ``0..a-1`` count as accepted trials, position ``a`` (if ``a < d``) as a
rejected one, later positions were not tested. The policy changes during training, so old
outcomes fade: a (fine, middle or coarse) cell past ``MEMORY`` trials (a middle cell: expected
tokens) has its counts (and issued-estimate sum) halved. One ``Calibration`` serves all rollout batches of
a drafter: updates run under a lock; the numba draft kernels read the estimate table without it
(a concurrent update can make a read one observation stale, never inconsistent: each float is
written whole).

Sources: SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975) scores drafts by expected
accepted length from empirical branch frequencies; here the frequencies are calibrated online.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import numba
import numpy as np
from jaxtyping import Float, Int

from rhyme_jax.config.sections import MAX_DRAFT

SOURCES = ("history", "self", "sibling")
HISTORY, SELF, SIBLING = 0, 1, 2
# match length m (tokens) -> bucket; m >= 64 shares the last bucket
MATCH_EDGES = (1, 2, 3, 4, 5, 7, 10, 16)  # bucket k holds MATCH_EDGES[k] <= m < MATCH_EDGES[k + 1]
DEPTH_EDGES = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24)  # draft position j (0-based), same rule
NUM_PROB = 12  # raw probability q: bucket floor(10 q) for q < 1, 10 for q == 1, 11 one occurrence
SINGLE = NUM_PROB - 1  # the bucket of a match that occurred once
MAX_DEPTH = MAX_DRAFT  # longest draft (config.sections.MAX_DRAFT, the engine's shapes.MAX_DRAFT)
S0 = 4.0  # pseudo-trials of a coarse cell's prior
S1 = 8.0  # pseudo-trials of a fine cell's prior (centred on its coarse cell)
S2 = 4.0  # pseudo-accepted tokens of a middle cell's prior factor
CAP = 0.99  # largest prior mean of a fine cell
HISTORY_SHRINK = 0.85  # prior acceptance of a history token = 0.85 x its branch share
AGREE_BASE = 0.9  # ... whose share is 1 over several occurrences (every one continued alike)
SINGLE_BASE = 0.425  # ... after a match that occurred once (0.85 x 0.5)
LOOKUP_BASE = 0.3  # prior acceptance of a self / sibling token (conservative)
MEMORY = 5000.0  # a cell past this many trials has its counts halved (older outcomes fade)


def _bucket_table(edges: tuple[int, ...], size: int) -> np.ndarray:
    return (np.searchsorted(np.asarray(edges), np.arange(size), side="right") - 1).clip(0).astype(np.int64)


MATCH_BUCKET = _bucket_table(MATCH_EDGES, 65)
# a middle cell's prior factor by match-length bucket: a continuation after a 1- or 2-token match
# is weak evidence however one-sided its branch counts (SuffixDecoding caps a draft at its match
# length for the same reason)
MATCH_PRIOR = np.array([0.35, 0.6, 0.8, 1.0, 1.0, 1.0, 1.0, 1.0])
DEPTH_BUCKET = _bucket_table(DEPTH_EDGES, MAX_DEPTH)
NUM_MATCH, NUM_DEPTH = len(MATCH_EDGES), len(DEPTH_EDGES)
NUM_CELLS = len(SOURCES) * NUM_MATCH * NUM_DEPTH * NUM_PROB
NUM_MID = len(SOURCES) * NUM_MATCH * NUM_DEPTH
NUM_COARSE = len(SOURCES) * NUM_PROB


class Estimates(NamedTuple):
    """What the draft kernels read of a ``Calibration`` (``Calibration.estimates``)."""

    table: np.ndarray  # float64[NUM_CELLS] current estimate of every cell
    top: float  # the largest entry of table (an upper bound walks prune with)


class Counts(NamedTuple):
    """A ``Calibration``'s counts and estimate table, which ``_update`` changes in place."""

    fine: np.ndarray  # float64[NUM_CELLS, 2] (accepted, tested) per cell
    mid: np.ndarray  # float64[NUM_MID, 2] (accepted, sum of coarse means) per middle cell
    coarse: np.ndarray  # float64[NUM_COARSE, 3] (accepted, tested, prior base) per coarse cell
    issued: np.ndarray  # float64[NUM_CELLS] sum of the estimates issued for tested tokens
    table: np.ndarray  # float64[NUM_CELLS] current estimate of every cell


@numba.njit(cache=True, nogil=True, inline="always")
def cell_of(source, match_len, depth, q, once):
    """Cell id of a draft token: ``source`` (0..2), match length (>= 1 tokens), draft position
    ``depth`` (0-based, < 32), raw probability ``q`` in (0, 1] and whether the match occurred
    once (``once``)."""
    mb = MATCH_BUCKET[min(match_len, 64)]
    db = DEPTH_BUCKET[min(depth, MAX_DEPTH - 1)]
    if once:
        pb = SINGLE
    elif q >= 1.0 - 1e-9:
        pb = SINGLE - 1
    else:
        pb = min(int(q * 10.0), SINGLE - 2)
    return ((source * NUM_MATCH + mb) * NUM_DEPTH + db) * NUM_PROB + pb


@numba.njit(cache=True, nogil=True, inline="always")
def coarse_of(cell):
    """Coarse cell (source, raw-probability bucket) of a fine cell."""
    return (cell // (NUM_MATCH * NUM_DEPTH * NUM_PROB)) * NUM_PROB + cell % NUM_PROB


@numba.njit(cache=True, nogil=True, inline="always")
def coarse_mean(coarse, cc):
    """Posterior mean of coarse cell ``cc``."""
    return (coarse[cc, 0] + S0 * coarse[cc, 2]) / (coarse[cc, 1] + S0)


@numba.njit(cache=True, nogil=True, inline="always")
def estimate(fine, mid, coarse, cell):
    """Posterior mean acceptance of ``cell`` (module docstring). ``fine f64[C, 2]`` = (accepted,
    trials) per fine cell; ``mid f64[Cm, 2]`` = (accepted, expected by coarse means) per middle
    cell (``cell // NUM_PROB``); ``coarse f64[Cc, 3]`` = (accepted, trials, prior base)."""
    m = cell // NUM_PROB
    r = (mid[m, 0] + S2 * MATCH_PRIOR[(m // NUM_DEPTH) % NUM_MATCH]) / (mid[m, 1] + S2)
    c = min(coarse_mean(coarse, coarse_of(cell)) * r, CAP)
    return (fine[cell, 0] + S1 * c) / (fine[cell, 1] + S1)


@numba.njit(cache=True, nogil=True)
def _refresh(fine, mid, coarse, table):
    """``table[c]`` = the estimate of every cell; returns the largest."""
    top = 0.0
    for c in range(fine.shape[0]):
        table[c] = estimate(fine, mid, coarse, c)
        top = max(top, table[c])
    return top


@numba.njit(cache=True, nogil=True)
def _update(counts, reqs, cells, ests, drafted, accepted):
    """Count the verify outcome of each row b (request ``reqs[b]``, whose last draft had cells
    ``cells[reqs[b]]`` and estimates ``ests[reqs[b]]``) into ``counts`` (``Counts``: ``fine`` /
    ``mid`` / ``coarse`` and the issued-estimate sums ``issued``; module docstring), forget those
    drafts (cells -1), refresh ``counts.table`` where it changed. Returns ``(code, largest entry of table)``; code 0 (the
    largest entry -1 when no token was tested: the table did not change), or, with nothing
    changed, 1 (a request out of range), 2 (a repeated request) or 3 (not
    ``0 <= accepted <= drafted``)."""
    fine, mid, coarse, issued, table = counts
    seen = np.zeros(cells.shape[0], np.bool_)
    for b in range(reqs.shape[0]):
        r = reqs[b]
        if r < 0 or r >= cells.shape[0]:
            return 1, 0.0
        if seen[r]:
            return 2, 0.0
        seen[r] = True
        if accepted[b] < 0 or accepted[b] > drafted[b]:
            return 3, 0.0
    touched = np.zeros(coarse.shape[0], np.bool_)
    touched_mid = np.zeros(mid.shape[0], np.bool_)
    for b in range(reqs.shape[0]):
        r = reqs[b]
        d = min(drafted[b], cells.shape[1])
        a = min(accepted[b], d)
        for j in range(min(a + 1, d)):
            c = cells[r, j]
            if c < 0:
                break
            hit = 1.0 if j < a else 0.0
            fine[c, 0] += hit
            fine[c, 1] += 1.0
            issued[c] += ests[r, j]
            if fine[c, 1] > MEMORY:
                fine[c, 0] *= 0.5
                fine[c, 1] *= 0.5
                issued[c] *= 0.5
            cc = coarse_of(c)
            m = c // NUM_PROB
            mid[m, 0] += hit
            mid[m, 1] += coarse_mean(coarse, cc)
            if mid[m, 1] > MEMORY:
                mid[m, 0] *= 0.5
                mid[m, 1] *= 0.5
            touched_mid[m] = True
            coarse[cc, 0] += hit
            coarse[cc, 1] += 1.0
            if coarse[cc, 1] > MEMORY:
                coarse[cc, 0] *= 0.5
                coarse[cc, 1] *= 0.5
            touched[cc] = True
        for j in range(cells.shape[1]):
            cells[r, j] = -1
    for cc in range(coarse.shape[0]):
        if touched[cc]:
            src, pb = cc // NUM_PROB, cc % NUM_PROB
            for k in range(NUM_MATCH * NUM_DEPTH):
                c = (src * NUM_MATCH * NUM_DEPTH + k) * NUM_PROB + pb
                table[c] = estimate(fine, mid, coarse, c)
    any_mid = False
    for m in range(mid.shape[0]):
        if touched_mid[m]:
            any_mid = True
            for pb in range(NUM_PROB):
                table[m * NUM_PROB + pb] = estimate(fine, mid, coarse, m * NUM_PROB + pb)
    if not any_mid:  # every tested token touches a middle cell: none was tested
        return 0, -1.0
    top = 0.0
    for c in range(table.shape[0]):
        top = max(top, table[c])
    return 0, top


def _i64(x) -> np.ndarray:
    """``x`` as an int64 array (no copy when it is one: ``update`` runs once per verify step)."""
    return x if type(x) is np.ndarray and x.dtype == np.int64 else np.asarray(x, np.int64)


def _label(edges: tuple[int, ...], k: int, last: int) -> str:
    lo = edges[k]
    hi = edges[k + 1] - 1 if k + 1 < len(edges) else last
    return str(lo) if lo == hi else f"{lo}-{hi}"


class Calibration:
    """Acceptance estimates per cell, updated online from verify outcomes (module docstring).

    Attributes (numpy, read by the numba draft kernels; modify only through ``update``):
      fine: ``float64[NUM_CELLS, 2]`` accepted and tested draft tokens per cell.
      mid: ``float64[NUM_MID, 2]`` accepted tokens and the sum of their coarse means per middle
        cell (``fine cell // NUM_PROB``).
      coarse: ``float64[NUM_COARSE, 3]`` the same per (source, raw-probability bucket) and the
        prior base acceptance.
      table: ``float64[NUM_CELLS]`` the current estimate of every cell (what the kernels read).
      top: largest entry of ``table`` (an upper bound the kernels prune with).
    """

    def __init__(self):
        self.fine = np.zeros((NUM_CELLS, 2), np.float64)
        self.mid = np.zeros((NUM_MID, 2), np.float64)
        self.coarse = np.zeros((NUM_COARSE, 3), np.float64)
        centres = (np.arange(SINGLE - 1) + 0.5) / 10.0  # buckets floor(10 q), q < 1
        self.coarse[HISTORY * NUM_PROB:(HISTORY + 1) * NUM_PROB, 2] = np.r_[HISTORY_SHRINK * centres, AGREE_BASE,
                                                                             SINGLE_BASE]
        self.coarse[NUM_PROB:, 2] = LOOKUP_BASE
        self.issued = np.zeros(NUM_CELLS, np.float64)
        self.table = np.zeros(NUM_CELLS, np.float64)
        self.top = float(_refresh(self.fine, self.mid, self.coarse, self.table))
        self._counts = Counts(self.fine, self.mid, self.coarse, self.issued, self.table)
        self._lock = threading.Lock()

    def estimates(self) -> Estimates:
        """The current ``table`` and ``top`` (what the draft kernels read; no copy)."""
        return Estimates(self.table, self.top)

    def update(self, reqs: Int[np.ndarray, "B"], cells: Int[np.ndarray, "R D"], ests: Float[np.ndarray, "R D"],
               drafted: Int[np.ndarray, "B"], accepted: Int[np.ndarray, "B"]) -> None:
        """Count one verify step: row b (request ``reqs[b]``, distinct) sent ``drafted[b]`` draft
        tokens, whose cells are ``cells[reqs[b], :drafted[b]]`` (-1 = none: nothing was drafted)
        and estimates ``ests[reqs[b]]``; the first ``accepted[b]`` were accepted. The counted
        rows of ``cells`` are set to -1 (each draft counts once). Thread-safe.

        Args:
          cells: ``int32[R, D]`` (C-contiguous; modified in place); ests: ``float32[R, D]``;
          reqs, drafted, accepted: ``int64[B]``.

        Raises:
          ValueError: wrong dtypes or shapes, requests out of range or repeated, or not
            ``0 <= accepted <= drafted`` (named).
        """
        reqs, drafted, accepted = _i64(reqs), _i64(drafted), _i64(accepted)
        b = (reqs.size,)
        if (reqs.ndim != 1 or cells.dtype != np.int32 or ests.dtype != np.float32 or cells.ndim != 2
                or ests.shape != cells.shape
                or not cells.flags.c_contiguous or drafted.shape != b or accepted.shape != b):
            raise ValueError(f"cells/ests/drafted/accepted: expected int32[R, D]/float32[R, D]/[B]/[B] (reqs [B]), got "
                             f"{cells.dtype}{cells.shape}/{ests.dtype}{ests.shape}/{drafted.shape}/{accepted.shape}")
        with self._lock:
            code, top = _update(self._counts, reqs, cells, ests, drafted, accepted)
            if code == 0 and top >= 0:
                self.top = float(top)
        if code:
            raise ValueError(("", f"reqs: expected requests in [0, {cells.shape[0]})",
                              "reqs: each request may appear once per observe()",
                              "accepted: expected 0 <= accepted <= drafted per row")[code])

    def estimate(self, source: str, match_len: int, depth: int, q: float = 1.0, once: bool = False) -> float:
        """Current estimate of one token (``source`` in ``SOURCES``; ``q`` its raw probability and
        ``once`` whether its match occurred once; ``cell_of``).

        Raises:
          ValueError: unknown source (named).
        """
        if source not in SOURCES:
            raise ValueError(f"source: expected one of {SOURCES}, got {source!r}")
        return float(self.table[cell_of(SOURCES.index(source), int(match_len), int(depth), float(q), bool(once))])

    def rows(self) -> list[dict]:
        """Every cell with tested tokens: ``source``, ``match`` / ``depth`` / ``prob`` bucket labels
        (match length in tokens, 0-based draft position, raw branch share; ``-`` for lookup
        sources), ``predicted`` (mean estimate issued for its tested tokens), ``observed``
        (accepted share), ``trials`` and the current ``estimate``."""
        with self._lock:
            fine, issued, table = self.fine.copy(), self.issued.copy(), self.table.copy()
        out = []
        for c in np.flatnonzero(fine[:, 1] > 0):
            rest, pb = divmod(int(c), NUM_PROB)
            rest, db = divmod(rest, NUM_DEPTH)
            src, mb = divmod(rest, NUM_MATCH)
            prob = "once" if pb == SINGLE else "1" if pb == SINGLE - 1 else f"{pb / 10:.1f}-{(pb + 1) / 10:.1f}"
            t = float(fine[c, 1])
            out.append(dict(source=SOURCES[src], match=_label(MATCH_EDGES, mb, 64),
                            depth=_label(DEPTH_EDGES, db, MAX_DEPTH - 1), prob=prob,
                            predicted=float(issued[c] / t), observed=float(fine[c, 0] / t), trials=int(t),
                            estimate=float(table[c])))
        return out
