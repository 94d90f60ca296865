"""Goodput drafting of one rollout batch: the best scored candidate per row, with estimates.

``spec.window = "goodput"`` (docs/architecture.md, "HistoSpec in one paragraph"). Each step every
row gets the candidate with the largest expected accepted length among

* the prompt's history index at every match length from the longest (<= ``pattern_max``) down
  to ``pattern_min`` (``candidates.py``; includes the prompt head at response start),
* the row's own earlier tokens (``spec.self_lookup``) and
* the same batch's other requests with the same prompt (``spec.siblings``) (both
  ``siblings.py``),

up to ``min(budget, 32)`` tokens (no window: the engine decides how many to send from the
per-token acceptance estimates). The estimates come from the drafter's shared online
``calibration.Calibration``, which ``observe`` feeds with each row's verify outcome.
RhymeRL (arXiv 2508.18588) s.4; SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975) s.3 for
scoring candidates by expected accepted length; prompt lookup decoding (Saxena 2023) for self.

One numba call per step (``draft_kernel``) runs all sources. Numba's on-disk cache keys a compiled
function on its own file only; ``kernel_cache.refresh`` (run when ``rhyme_jax.spec`` is imported)
drops the cached kernels whenever any kernel source changed, so ``draft_kernel`` never keeps the
old code of what it calls. The kernel takes its state as a few records (``RequestState``,
``DraftOut`` and those of ``candidates``, ``siblings``, ``sam_kernels`` and ``calibration``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numba
import numpy as np
from jaxtyping import Float, Int

from rhyme_jax.spec.calibration import Calibration
from rhyme_jax.spec.candidates import MAX_DRAFT, Candidates, DraftRows, HistoryPack, history_candidates
from rhyme_jax.spec.sam_kernels import DraftRule
from rhyme_jax.spec.siblings import LookupSources, SequenceStore, has_room, lookup_candidates
from rhyme_jax.spec.suffix_index import BRANCHES


class RequestState(NamedTuple):
    """Per-request state of one batch's goodput drafting (R requests, K = ``MAX_DRAFT``)."""

    slots: np.ndarray  # int64[R] history index of each request (-1: none)
    grow: np.ndarray  # int64[R] tokens its next tail adds (-1: unknown)
    memo: np.ndarray  # int64[R, 3] its last history match (state, length, window hash; -1 none)
    cells: np.ndarray  # int32[R, K] calibration cells of its last draft (-1: none)
    ests: np.ndarray  # float32[R, K] estimates of its last draft
    predicted: np.ndarray  # float64[R] tokens the history predicts it generates
    emitted: np.ndarray  # int64[R] tokens it emitted so far


class DraftOut(NamedTuple):
    """What ``draft_kernel`` writes for B rows (K = ``MAX_DRAFT``)."""

    tokens: np.ndarray  # int32[B, K] draft tokens (0 past lens[b])
    est: np.ndarray  # float32[B, K] acceptance estimate of each token (0 past lens[b])
    lens: np.ndarray  # int32[B] draft length
    prio: np.ndarray  # float32[B] max(predicted - emitted, 0) of the row's request


@numba.njit(cache=True, nogil=True)
def _finish(reqs, best, requests):
    """Zero each row of ``best`` (``Candidates``) past its draft, remember its cells / estimates
    per request in ``requests`` (``RequestState``; for ``observe``), mark its growth unknown until
    ``observe``; returns the longest draft."""
    out, est, cell, lens = best.tokens, best.est, best.cell, best.lens
    k = 0
    for b in range(reqs.shape[0]):
        r = reqs[b]
        requests.grow[r] = -1
        n = lens[b]
        k = max(k, n)
        for j in range(MAX_DRAFT):
            if j >= n:
                out[b, j] = 0
                est[b, j] = 0.0
                cell[b, j] = -1
            requests.cells[r, j] = cell[b, j]
            requests.ests[r, j] = est[b, j]
    return k


@numba.njit(cache=True, nogil=True)
def _note(reqs, accepted, grow, emitted):
    """After a verify step: request ``reqs[b]`` emitted ``accepted[b] + 1`` tokens, which its next
    tail adds (``grow``: added to what earlier steps without a draft in between noted, e.g. the
    engine's backoff; a draft resets it to -1) and which count towards its emitted total
    (``emitted``)."""
    for b in range(reqs.shape[0]):
        r = reqs[b]
        grow[r] = accepted[b] + 1 + max(grow[r], 0)
        emitted[r] += accepted[b] + 1


@numba.njit(cache=True, nogil=True)
def _prologue(requests, rows, sources, store, prio):
    """Checks of one draft step and each row's priority ``prio[b] = max(predicted[r] -
    emitted[r], 0)`` (``requests``: ``RequestState``). Returns 0, 1 (a request out of ``[0, R)``)
    or 2 (lookup ``sources`` on and the sequence ``store`` needs room first:
    ``SequenceStore.reserve``)."""
    reqs = rows.reqs
    for b in range(reqs.shape[0]):
        r = reqs[b]
        if r < 0 or r >= requests.slots.shape[0]:
            return 1
    if (sources.self_lookup or sources.siblings) and not has_room(store, requests.grow, reqs, rows.tails):
        return 2
    for b in range(reqs.shape[0]):
        r = reqs[b]
        prio[b] = max(requests.predicted[r] - requests.emitted[r], 0.0)
    return 0


@numba.njit(cache=True, nogil=True)
def draft_kernel(hist, requests, rows, rule, sources, cal, store, out):
    """One goodput draft step in one call: ``_prologue`` (returns -1 / -2 for its codes 1 / 2,
    nothing changed), history candidates (``history_candidates`` over ``hist``, a
    ``candidates.HistoryTables``), then, if ``sources`` (``siblings.LookupSources``) has one on,
    the self / sibling candidates (``lookup_candidates`` over ``store``, a
    ``siblings.StoreArrays``), then ``_finish``. ``requests``: ``RequestState``; ``rows``:
    ``candidates.DraftRows``; ``rule``: ``sam_kernels.DraftRule``; ``cal``:
    ``calibration.Estimates``; ``out``: ``DraftOut``. Returns the longest draft."""
    code = _prologue(requests, rows, sources, store, out.prio)
    if code:
        return -code
    b = rows.reqs.shape[0]
    cell = np.empty((b, MAX_DRAFT), np.int32)
    score = np.empty(b, np.float64)
    rs = np.empty(b, np.int64)
    for i in range(b):
        rs[i] = requests.slots[rows.reqs[i]]
    best = Candidates(out.tokens, out.est, cell, out.lens, score)
    history_candidates(hist, rs, rows, requests.grow, requests.memo, rule, cal, best)
    if sources.self_lookup or sources.siblings:
        lookup_candidates(store, requests.grow, rows, rule, sources, cal, best)
    return _finish(rows.reqs, best, requests)


class GoodputDrafts:
    """Per-batch state of goodput drafting: the last draft's calibration cells and estimates per
    request (what ``observe`` counts) and, with self-lookup or siblings, the ``SequenceStore``.

    Args:
      parent: the ``Drafter`` (settings and the shared ``Calibration``).
      pack / slots: the batch's indexes (``candidates.HistoryPack``) and each request's slot
        (-1: no history).
      groups: ``int[R]`` group of each request (same prompt id = same group).
    """

    def __init__(self, parent: Any, pack: HistoryPack, slots: np.ndarray, groups: np.ndarray):
        self.parent = parent
        self.calibration: Calibration = parent._calibration
        self.pack, self.slots = pack, slots
        r = slots.size
        self.cells = np.full((r, MAX_DRAFT), -1, np.int32)
        self.ests = np.zeros((r, MAX_DRAFT), np.float32)
        self.grow = np.full(r, -1, np.int64)  # tokens each request's next tail adds (observe)
        self.memo = np.full((r, 3), -1, np.int64)  # its last history match (state, length, window hash)
        self.lookup = parent.self_lookup or parent.siblings
        self.rule = DraftRule(BRANCHES[parent.branch], float(parent.min_token_prob), int(parent.pattern_max),
                              int(parent.pattern_min))
        self.sources = LookupSources(bool(parent.self_lookup), bool(parent.siblings))
        # without lookup sources the kernel gets an empty store (one compiled signature)
        self.store = SequenceStore(groups if self.lookup else np.zeros(0, np.int64), parent.pattern_min,
                                   parent.pattern_max, cap=512 if self.lookup else 1)
        self._zeros = (np.zeros(r, np.float64), np.zeros(r, np.int64))

    def draft(self, reqs: Int[np.ndarray, "B"], tails: Int[np.ndarray, "B W"], budgets: Int[np.ndarray, "B"],
              predicted: Float[np.ndarray, "R"] | None = None, emitted: Int[np.ndarray, "R"] | None = None
              ) -> tuple[Int[np.ndarray, "B K"], Int[np.ndarray, "B"], Float[np.ndarray, "B K"],
                         Float[np.ndarray, "B"]]:
        """Best candidate of each row (module docstring), at most ``min(budgets[b], 32)`` tokens.

        Args:
          reqs: ``int64[B]`` distinct request indices; tails: ``int[B, W]`` (W >= pattern_max)
            left-padded with -1; budgets: ``int64[B]``.
          predicted / emitted: ``float64[R]`` / ``int64[R]`` tokens the history predicts each
            request generates and those it emitted so far (default: zeros).

        Returns:
          ``(tokens int32[B, K], lens int32[B], estimates float32[B, K], priorities float32[B])``;
          K = max(lens); estimates in (0, 1) where ``j < lens[b]``, 0 after (padding tokens are 0
          too); priorities ``max(predicted - emitted, 0)`` per row.

        Raises:
          ValueError: a request out of range (named).
        """
        cal, st = self.calibration, self.store
        b = reqs.size
        if tails.dtype != np.int32 or not tails.flags.c_contiguous:
            tails = np.ascontiguousarray(tails, np.int32)
        if predicted is None:
            predicted, emitted = self._zeros
        requests = RequestState(self.slots, self.grow, self.memo, self.cells, self.ests, predicted, emitted)
        rows = DraftRows(reqs, tails, budgets)
        out = DraftOut(np.empty((b, MAX_DRAFT), np.int32), np.empty((b, MAX_DRAFT), np.float32), np.empty(b, np.int32),
                       np.empty(b, np.float32))
        for _ in range(2):
            k = draft_kernel(self.pack.tables, requests, rows, self.rule, self.sources, cal.estimates(), st.arrays(),
                             out)
            if k != -2:
                break
            st.reserve(reqs, tails, self.grow)  # room first, then the same step again
        if k == -1:
            raise ValueError(f"reqs: expected request indices in [0, {self.slots.size}) of the batch given to "
                             f"Drafter.batch(), got {reqs.tolist()}")
        return out.tokens[:, :k], out.lens, out.est[:, :k], out.prio

    def observe(self, reqs: Int[np.ndarray, "B"], drafted: Int[np.ndarray, "B"], accepted: Int[np.ndarray, "B"],
                emitted: Int[np.ndarray, "R"]) -> None:
        """Feed the calibration with each row's verify outcome (``drafted`` tokens sent after the
        engine's cuts, the first ``accepted`` accepted), note how many tokens the next tails
        add (the history match and the sequence store advance by those) and add them to
        ``emitted`` (``int64[R]``, per request). The drafts observed are forgotten (a request
        observed twice without a draft in between counts once). All ``int64``.

        Raises:
          ValueError: repeated requests or not ``0 <= accepted <= drafted`` (named; nothing
            noted then).
        """
        self.calibration.update(reqs, self.cells, self.ests, drafted, accepted)
        _note(reqs, accepted, self.grow, emitted)

    def observe_chunk(self, reqs: Int[np.ndarray, "B"], drafted: Int[np.ndarray, "B"],
                      accepted: Int[np.ndarray, "B"], counts: Int[np.ndarray, "B"], emitted: Int[np.ndarray, "R"]) -> None:
        """After a chunk of passes drafted on the device (``rollout/chunk_spec.py``): the last
        host draft's outcome had it been verified (``accepted``: how many of its first ``drafted``
        tokens the chunk emitted) feeds the calibration; each request emitted ``counts`` tokens
        (added to ``emitted``). The tails' growth stays unknown (the next draft re-reads them).

        Raises:
          ValueError: as ``observe``.
        """
        self.calibration.update(reqs, self.cells, self.ests, drafted, accepted)
        emitted[reqs] += counts
