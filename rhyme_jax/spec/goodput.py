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
old code of what it calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numba
import numpy as np
from jaxtyping import Float, Int

from rhyme_jax.spec.calibration import Calibration
from rhyme_jax.spec.candidates import MAX_DRAFT, HistoryPack, history_candidates
from rhyme_jax.spec.siblings import SequenceStore, has_room, lookup_candidates

if TYPE_CHECKING:
    from rhyme_jax.spec.drafter import Drafter


@numba.njit(cache=True, nogil=True)
def _finish(reqs, out, est, cell, lens, cells_state, ests_state, grow):
    """Zero each row past its draft, remember its cells / estimates per request (for
    ``observe``), mark its growth unknown until ``observe``; returns the longest draft."""
    k = 0
    for b in range(reqs.shape[0]):
        r = reqs[b]
        grow[r] = -1
        n = lens[b]
        k = max(k, n)
        for j in range(MAX_DRAFT):
            if j >= n:
                out[b, j] = 0
                est[b, j] = 0.0
                cell[b, j] = -1
            cells_state[r, j] = cell[b, j]
            ests_state[r, j] = est[b, j]
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
def _prologue(reqs, num_reqs, pred, emitted, prio, lookup, seq, grams, used, slen, grow, tails):
    """Checks of one draft step and each row's priority ``prio[b] = max(pred[r] - emitted[r], 0)``.
    Returns 0, 1 (a request out of ``[0, num_reqs)``) or 2 (the sequence store needs room first:
    ``SequenceStore.reserve``)."""
    for b in range(reqs.shape[0]):
        r = reqs[b]
        if r < 0 or r >= num_reqs:
            return 1
    if lookup and not has_room(seq, grams, used, slen, grow, reqs, tails):
        return 2
    for b in range(reqs.shape[0]):
        r = reqs[b]
        prio[b] = max(pred[r] - emitted[r], 0.0)
    return 0


@numba.njit(cache=True, nogil=True)
def draft_kernel(so, ho, states, trans, slots, reqs, grow, memo, tails, budgets, min_prob, pmax, pmin, table, top,
                 lookup, use_self, use_sib, seq, prev, slen, seg, grams, used, groups, cells_state, ests_state, out,
                 est, lens, pred, emitted, prio):
    """One goodput draft step in one call: ``_prologue`` (returns -1 / -2 for its codes 1 / 2,
    nothing changed), history candidates (``history_candidates``; the first four arguments are
    a ``HistoryPack``, ``slots`` per request; ``grow`` tokens each request's tail gained since
    its last draft, -1 unknown; ``memo`` its last history match), then, if ``lookup``, the self /
    sibling candidates (``lookup_candidates`` over a ``SequenceStore``'s arrays), then
    ``_finish``. Returns the longest draft."""
    code = _prologue(reqs, slots.shape[0], pred, emitted, prio, lookup, seq, grams, used, slen, grow, tails)
    if code:
        return -code
    b = reqs.shape[0]
    cell = np.empty((b, MAX_DRAFT), np.int32)
    score = np.empty(b, np.float64)
    rs = np.empty(b, np.int64)
    for i in range(b):
        rs[i] = slots[reqs[i]]
    history_candidates(so, ho, states, trans, rs, reqs, grow, memo, tails, budgets, min_prob, pmax, pmin, table, top,
                       out, est, cell, lens, score)
    if lookup:
        lookup_candidates(seq, prev, slen, seg, grow, grams, used, groups, reqs, tails, budgets, pmin, pmax, use_self,
                          use_sib, table, out, est, cell, lens, score)
    return _finish(reqs, out, est, cell, lens, cells_state, ests_state, grow)


class GoodputDrafts:
    """Per-batch state of goodput drafting: the last draft's calibration cells and estimates per
    request (what ``observe`` counts) and, with self-lookup or siblings, the ``SequenceStore``.

    Args:
      parent: the ``Drafter`` (settings and the shared ``Calibration``).
      pack / slots: the batch's indexes (``candidates.HistoryPack``) and each request's slot
        (-1: no history).
      groups: ``int[R]`` group of each request (same prompt id = same group).
    """

    def __init__(self, parent: "Drafter", pack: HistoryPack, slots: np.ndarray, groups: np.ndarray):
        self.parent = parent
        self.calibration: Calibration = parent._calibration
        self.pack, self.slots = pack, slots
        r = slots.size
        self.cells = np.full((r, MAX_DRAFT), -1, np.int32)
        self.ests = np.zeros((r, MAX_DRAFT), np.float32)
        self.grow = np.full(r, -1, np.int64)  # tokens each request's next tail adds (observe)
        self.memo = np.full((r, 3), -1, np.int64)  # its last history match (state, length, window hash)
        self.lookup = parent.self_lookup or parent.siblings
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
        p, cal, st = self.parent, self.calibration, self.store
        b = reqs.size
        if tails.dtype != np.int32 or not tails.flags.c_contiguous:
            tails = np.ascontiguousarray(tails, np.int32)
        if predicted is None:
            predicted, emitted = self._zeros
        out = np.empty((b, MAX_DRAFT), np.int32)
        est = np.empty((b, MAX_DRAFT), np.float32)
        lens = np.empty(b, np.int32)
        prio = np.empty(b, np.float32)
        for _ in range(2):
            k = draft_kernel(*self.pack.args(), self.slots, reqs, self.grow, self.memo, tails, budgets,
                             p.min_token_prob, p.pattern_max, p.pattern_min, cal.table, cal.top, self.lookup,
                             p.self_lookup, p.siblings, st.seq, st.prev, st.slen, st.seg, st.grams, st.used,
                             st.groups, self.cells, self.ests, out, est, lens, predicted, emitted, prio)
            if k != -2:
                break
            st.reserve(reqs, tails, self.grow)  # room first, then the same step again
        if k == -1:
            raise ValueError(f"reqs: expected request indices in [0, {self.slots.size}) of the batch given to "
                             f"Drafter.batch(), got {reqs.tolist()}")
        return out[:, :k], lens, est[:, :k], prio

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
