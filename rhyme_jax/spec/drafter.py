"""HistoSpec drafter: what the rollout engine calls every decode step.

Overview: docs/architecture.md, "HistoSpec in one paragraph".

Per rollout batch (``Drafter.batch(prompt ids)`` -> ``DraftBatch``) each request is tied to
its prompt's suffix index (built from the history store in a background thread by ``rebuild``);
every step ``draft`` returns one padded ``int32[B, K]`` draft batch (K = the longest draft; the
engine fits drafts to its step shapes) and ``observe`` updates each request's draft window.
A ``DraftBatch`` is what ``rhyme_jax.rollout.types.Drafter`` (the engine's protocol) describes.
RhymeRL (arXiv 2508.18588) s.4.

With ``spec.window = "goodput"`` there is no window: each row gets the best-scored candidate of
every source (``goodput.py``) with per-token acceptance estimates (``DraftBatch.estimates``)
calibrated online in one table per drafter (``Drafter.calibration``).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Sequence

import numpy as np
from jaxtyping import Int

from rhyme_jax.config.sections import MAX_DRAFT
from rhyme_jax.spec.calibration import Calibration
from rhyme_jax.spec.candidates import HistoryPack
from rhyme_jax.spec.goodput import GoodputDrafts
from rhyme_jax.spec.history import HistoryEntry, HistoryStore
from rhyme_jax.spec.lengths import predict_lengths
from rhyme_jax.spec.self_lookup import self_lookup_drafts
from rhyme_jax.spec.suffix_index import IndexPack, SuffixIndex, check_draft_args, draft_batch
from rhyme_jax.spec.window import initial_window, next_window

if TYPE_CHECKING:
    from rhyme_jax.config import SpecSection

SELF_LOOKUP_WIDTH = 256  # tokens of the running sequence searched by spec.self_lookup
PROMPT_TAIL = 8  # prompt tokens before each response in ``DraftBatch.history_rows``


def index_of(entry: HistoryEntry) -> SuffixIndex:
    """Suffix index of one history entry: its prompt and all kept responses with their rewards."""
    resp = [r for ro in entry.rollouts for r in ro.responses]
    rewards = np.concatenate([ro.rewards for ro in entry.rollouts])
    return SuffixIndex.build(entry.prompt, resp, rewards)


class Drafter:
    """Batched HistoSpec drafts for the requests of one rollout batch.

    Args:
      cfg: the run's ``spec`` section (``rhyme_jax.config.SpecSection``): ``branch``, ``window``, ``fixed_window``,
        ``min_token_prob``, ``pattern_max``, ``pattern_min`` and, optional, ``self_lookup``, ``siblings``.
      store: the history store the indexes are built from.

    Attributes:
      seconds: accumulated host time inside ``draft`` (metric "host drafting seconds").

    Raises:
      ValueError: a bad config value (named).
    """

    def __init__(self, cfg: SpecSection, store: HistoryStore):
        self.branch = str(cfg.branch)
        self.window_policy = str(cfg.window)
        self.fixed_window = int(cfg.fixed_window)
        self.min_token_prob = float(cfg.min_token_prob)
        self.pattern_max = int(cfg.pattern_max)
        self.pattern_min = int(cfg.pattern_min)
        # Extension beyond the paper: fall back to the sequence's own earlier tokens.
        self.self_lookup = bool(getattr(cfg, "self_lookup", False))
        self.goodput = self.window_policy == "goodput"
        # Extension (goodput only): draft from the batch's other requests with the same prompt.
        self.siblings = bool(getattr(cfg, "siblings", False)) and self.goodput
        # Tokens of each running sequence the engine passes as ``tails``.
        wide = self.self_lookup or self.siblings
        self.context_width = SELF_LOOKUP_WIDTH if wide else self.pattern_max
        check_draft_args(self.branch, self.min_token_prob, self.pattern_max, self.pattern_min)
        if not self.goodput:
            initial_window(self.window_policy, 0, self.fixed_window)  # validates window/fixed_window
        self._calibration = Calibration()
        self.store = store
        self.seconds = 0.0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="histospec-index")
        self._lock = threading.Lock()
        self._built: dict[int, tuple[HistoryEntry, SuffixIndex]] = {}
        self._pending: dict[int, Future] = {}

    # ---------------------------------------------------------------- indexes

    def _build(self, pid: int) -> None:
        """Index the store's current entry of ``pid`` (or forget the prompt if it has none)."""
        entry = self.store.entry(pid)
        index = None if entry is None else index_of(entry)
        if index is not None and self.goodput:
            index.compact(self.branch)  # what goodput drafting reads, made off the critical path
        with self._lock:
            if entry is None:
                self._built.pop(pid, None)
            else:
                self._built[pid] = (entry, index)

    def rebuild(self, prompt_ids: Sequence[int]) -> None:
        """(Re)build these prompts' indexes from the store in the background thread (in call
        order); ``batch`` uses the finished ones. Call right after ``store.update``."""
        for pid in dict.fromkeys(int(p) for p in prompt_ids):
            fut = self._pool.submit(self._build, pid)
            with self._lock:
                self._pending[pid] = fut

    def _index(self, pid: int) -> SuffixIndex | None:
        """The prompt's current index. A build already running is waited for; one still queued
        behind other prompts' builds is cancelled and done here instead; a store entry without a
        finished index (e.g. a store loaded from a checkpoint) is indexed here."""
        with self._lock:
            fut = self._pending.get(pid)
        if fut is not None:
            if not fut.cancel():
                fut.result()  # waits for a running build; re-raises a failed one
            with self._lock:
                if self._pending.get(pid) is fut:
                    del self._pending[pid]
        entry = self.store.entry(pid)
        if entry is None:
            return None
        with self._lock:
            built = self._built.get(pid)
        if built is None or built[0] is not entry:
            self._build(pid)
            with self._lock:
                built = self._built.get(pid)
        return None if built is None else built[1]

    # ---------------------------------------------------------------- per batch / per step
    def batch(self, prompt_ids: Sequence[int]) -> "DraftBatch":
        """A drafting session for one rollout batch (request r has prompt id ``prompt_ids[r]``):
        its own windows over this drafter's shared indexes, so concurrent rollout workers each
        drive their own batch. Requests whose prompt has no history draft nothing (cold start)."""
        pids = [int(p) for p in prompt_ids]
        indexes: list[SuffixIndex] = []
        slot_of: dict[int, int] = {}
        group_of = {pid: g for g, pid in enumerate(dict.fromkeys(pids))}
        for pid in group_of:
            ix = self._index(pid)
            if ix is not None:
                slot_of[pid] = len(indexes)
                indexes.append(ix)
        pack = HistoryPack(indexes, self.branch) if self.goodput else IndexPack.of(indexes)
        batch = DraftBatch(self, pack, np.array([slot_of.get(p, -1) for p in pids], np.int64),
                           np.array([group_of[p] for p in pids], np.int64), pids)
        if self.goodput:  # makespan priority: each request's prompt's mean length last time, 0 unseen
            means = dict(zip(group_of, predict_lengths(self.store, list(group_of), "mean", unseen=0.0).tolist()))
            batch.predicted_lengths = np.array([means[p] for p in pids], np.float64)
        return batch

    def calibration(self) -> list[dict]:
        """The goodput acceptance table (shared by this drafter's batches): one row per cell with
        tested draft tokens, as ``calibration.Calibration.rows`` (source, match / depth / prob
        buckets, predicted, observed, trials, estimate). Empty unless ``window = "goodput"``."""
        return self._calibration.rows()

    def close(self) -> None:
        """Stop the background build thread (queued builds are dropped, a running one finishes)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "Drafter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _int64(x) -> np.ndarray:
    """``x`` as an int64 array (no copy when it is one)."""
    return x if type(x) is np.ndarray and x.dtype == np.int64 else np.asarray(x, np.int64)


class DraftBatch:
    """Drafting state of one rollout batch (``Drafter.batch``): which index each request uses
    and its draft window. The engine calls ``draft`` every decode step and ``observe`` after it.

    Attributes:
      context_width: from the parent drafter (how many tokens ``tails`` must hold).
      seconds: host time inside ``draft`` (also added to the parent's ``seconds``).
      estimates: after each ``draft`` with ``window = "goodput"``, ``float32[B, K]`` estimated
        probability that draft token j of row b is accepted given that tokens ``< j`` were (in
        (0, 1) for ``j < lens[b]``, 0 after); ``None`` with the window policies.
      priorities: after each goodput ``draft``, ``float32[B]`` tokens the history predicts each
        row still has to generate (its prompt's mean response length last time minus the tokens
        it emitted in verified passes so far, >= 0; 0 without history), so the engine can favour
        the rows that bound the rollout's makespan; ``None`` with the window policies.
    """

    def __init__(self, parent: Drafter, pack: IndexPack | HistoryPack, slots: np.ndarray,
                 groups: np.ndarray | None = None, prompt_ids: Sequence[int] | None = None):
        self.parent = parent
        self.context_width = parent.context_width
        self.groups = np.arange(slots.size, dtype=np.int64) if groups is None else np.asarray(groups, np.int64)
        self.siblings = parent.siblings
        self.pattern_min = parent.pattern_min
        self._prompt_ids = list(prompt_ids) if prompt_ids is not None else None
        self._history: dict[int, np.ndarray] = {}
        self._pack, self._slots = pack, slots
        self.seconds = 0.0
        self.estimates: np.ndarray | None = None
        self.priorities: np.ndarray | None = None
        self.predicted_lengths = np.zeros(slots.size, np.float64)
        self._emitted = np.zeros(slots.size, np.int64)
        self._goodput: GoodputDrafts | None = None
        if parent.goodput:  # no window: drafts up to 32 tokens, the engine sizes them
            self._window = np.full(slots.size, MAX_DRAFT, np.int32)
            groups = np.arange(slots.size, dtype=np.int64) if groups is None else groups
            self._goodput = GoodputDrafts(parent, pack, slots, groups)
        else:
            self._window = initial_window(parent.window_policy, slots.size, parent.fixed_window)

    def _reqs(self, reqs) -> np.ndarray:
        r = np.asarray(reqs, dtype=np.int64)
        if r.ndim != 1 or (r.size and (r.min() < 0 or r.max() >= self._slots.size)):
            raise ValueError(f"reqs: expected 1-D request indices in [0, {self._slots.size}) of the "
                             f"batch given to Drafter.batch(), got {np.asarray(reqs).tolist()}")
        return r

    def draft(
        self,
        reqs: Int[np.ndarray, "B"],
        tails: Int[np.ndarray, "B P"],
        budgets: Int[np.ndarray, "B"],
    ) -> tuple[Int[np.ndarray, "B K"], Int[np.ndarray, "B"]]:
        """Drafts of B running requests.

        Args:
          reqs: ``int[B]`` request index (into the batch's prompt ids) of each row.
          tails: ``int[B, P]`` last P tokens of each running sequence (prompt + generated),
            left-padded with -1; ``P >= pattern_max`` (``context_width`` when self-lookup is on:
            the whole row is searched then, the index sees the last ``pattern_max``).
          budgets: ``int[B]`` most draft tokens each row may take (e.g. tokens left before
            max_new_tokens or the KV capacity).

        Returns:
          ``(drafts int32[B, K], lens int32[B])``; lens[b] <= min(window[reqs[b]], budgets[b]);
          padding 0; K = max(lens). Row b equals ``SuffixIndex.draft`` of its prompt's index
          (or, with self-lookup, ``self_lookup_drafts`` of its tail where the index has none).
          With ``window = "goodput"``: the best candidate of ``goodput.GoodputDrafts.draft``
          (``lens[b] <= min(32, budgets[b])``) and ``estimates`` set.

        Raises:
          ValueError: shapes or request indices that do not fit (named).
        """
        t0 = time.perf_counter()
        p = self.parent
        goodput = self._goodput is not None
        # the goodput kernel checks the request range itself (one call per step)
        r = _int64(reqs) if goodput else self._reqs(reqs)
        budgets = _int64(budgets)
        tails = np.asarray(tails)
        if r.ndim != 1 or budgets.shape != r.shape:
            raise ValueError(f"reqs, budgets: expected two 1-D arrays of one length, got {r.shape}, {budgets.shape}")
        if tails.ndim != 2 or tails.shape[0] != r.size:
            raise ValueError(f"tails: expected shape ({r.size}, P), got {tails.shape}")
        if tails.shape[1] < p.pattern_max:
            raise ValueError(f"tails: need at least pattern_max={p.pattern_max} columns, got {tails.shape[1]}")
        if goodput:  # no window: the kernel caps drafts at 32 tokens
            drafts, lens, self.estimates, self.priorities = self._goodput.draft(r, tails, budgets,
                                                                                self.predicted_lengths, self._emitted)
            self._spent(time.perf_counter() - t0)
            return drafts, lens
        max_lens = np.minimum(self._window[r], budgets)
        out, lens = draft_batch(self._pack, self._slots[r], np.ascontiguousarray(tails[:, -p.pattern_max:]),
                                max_lens, branch=p.branch, min_token_prob=p.min_token_prob,
                                pattern_max=p.pattern_max, pattern_min=p.pattern_min)
        if p.self_lookup:
            miss = np.flatnonzero((lens == 0) & (max_lens > 0))
            if miss.size:
                own, own_lens = self_lookup_drafts(tails[miss], max_lens[miss], pattern_max=p.pattern_max,
                                                   pattern_min=p.pattern_min, max_draft=MAX_DRAFT)
                width = max(out.shape[1], int(own_lens.max(initial=0)))
                if width > out.shape[1]:
                    out = np.concatenate([out, np.zeros((out.shape[0], width - out.shape[1]), out.dtype)], axis=1)
                w = min(width, own.shape[1])
                out[miss, :w] = own[:, :w]
                lens = lens.copy()
                lens[miss] = own_lens
        k = int(lens.max(initial=0))
        drafts = np.zeros((r.size, k), np.int32)
        w = min(k, out.shape[1])
        drafts[:, :w] = out[:, :w]
        self._spent(time.perf_counter() - t0)
        return drafts, lens

    def history_rows(self, reqs: Int[np.ndarray, "B"], width: int) -> Int[np.ndarray, "B H"]:
        """``int32[B, width]`` per request: its prompt's stored responses (every kept rollout,
        oldest first, so the most recent response ends the row), each after the prompt's last
        ``PROMPT_TAIL`` tokens (so a response's first tokens match after the prompt) and followed
        by ``-1``, cut to the last ``width`` tokens and left-padded with ``-1`` (all ``-1``
        without history). What ``rollout/chunk_spec.py`` drafts from on the device; built once
        per prompt."""
        out = np.full((len(reqs), width), -1, np.int32)
        if self._prompt_ids is None:
            return out
        for i, r in enumerate(np.asarray(reqs, np.int64)):
            pid = self._prompt_ids[int(r)]
            row = self._history.get(pid)
            if row is None or row.size != width:
                entry = self.parent.store.entry(pid)
                head = None if entry is None else np.asarray(entry.prompt, np.int32)[-PROMPT_TAIL:]
                parts = [] if entry is None else [
                    np.concatenate([head, np.asarray(x, np.int32), [-1]]).astype(np.int32)
                    for ro in entry.rollouts for x in ro.responses]
                joined = np.concatenate(parts)[-width:] if parts else np.zeros(0, np.int32)
                row = np.full(width, -1, np.int32)
                row[width - joined.size:] = joined
                self._history[pid] = row
            out[i] = row
        return out

    def _spent(self, dt: float) -> None:
        self.seconds += dt
        self.parent.seconds += dt

    def observe(self, reqs: Int[np.ndarray, "B"], drafted: Int[np.ndarray, "B"],
                accepted: Int[np.ndarray, "B"]) -> None:
        """Window update after a verify step (``window.next_window``) for distinct requests;
        with ``window = "goodput"`` the calibration update instead (``GoodputDrafts.observe``).

        Raises:
          ValueError: repeated or out-of-range requests, or bad drafted/accepted (named).
        """
        if self._goodput is not None:  # the calibration checks range and repeats as it counts
            self._goodput.observe(_int64(reqs), _int64(drafted), _int64(accepted), self._emitted)
            return
        r = self._reqs(reqs)
        if np.unique(r).size != r.size:
            raise ValueError("reqs: each request may appear once per observe()")
        p = self.parent
        self._window[r] = next_window(p.window_policy, self._window[r], drafted, accepted, p.fixed_window)

    def observe_chunk(self, reqs: Int[np.ndarray, "B"], drafted: Int[np.ndarray, "B"],
                      accepted: Int[np.ndarray, "B"], counts: Int[np.ndarray, "B"]) -> None:
        """After a chunk of passes that drafted on the device (``rollout/chunk_spec.py``):
        ``drafted`` / ``accepted``: the last ``draft``'s lengths as sent and how many of them
        the chunk emitted (the outcome a verify pass would have had); ``counts``: tokens each
        request emitted in the chunk. Goodput: ``GoodputDrafts.observe_chunk``; the window
        policies: the window update of ``observe``."""
        r = _int64(reqs)
        if self._goodput is not None:
            self._goodput.observe_chunk(r, _int64(drafted), _int64(accepted), _int64(counts), self._emitted)
            return
        self.observe(r, drafted, accepted)

    @property
    def idle(self) -> bool:
        """Whether no request of this batch can ever get a draft: none of their prompts has
        history and neither self-lookup nor siblings is on (a run's first epoch). The engine then
        decodes plainly without calling ``draft`` (``rollout.types.Drafter``)."""
        p = self.parent
        return not (self._slots >= 0).any() and not (p.self_lookup or p.siblings)

    @property
    def windows(self) -> Int[np.ndarray, "R"]:
        """Copy of the current ``int32[R]`` windows of the batch's requests."""
        return self._window.copy()
