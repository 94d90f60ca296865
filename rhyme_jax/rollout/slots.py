"""Host-side bookkeeping of one ``RolloutEngine.generate`` call: the slot table.

A ``SlotTable`` holds what the engine's loop reads and writes between forward passes (numpy
only, no device work): which request sits in each decode slot and how far it got, the
per-request outputs, the waiting queue, which slots hold a prompt's shared prefix pages, and the
call's counters. Its methods are the loop's host steps: ``admit`` (choose one packed prefill
batch), ``grow_pages`` (a page for every slot about to cross a page boundary, preempting the
newest sequence when the pool runs dry), ``record`` (append emitted tokens; EOS / length stop),
``preempt``, ``release`` and ``stop`` (requests the migration monitor takes away).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

import numpy as np
from jaxtyping import Float, Int

from rhyme_jax.rollout.page_allocator import PageAllocator
from rhyme_jax.rollout.tails import ContextTails
from rhyme_jax.rollout.types import EngineConfigError, Progress, RolloutResult, derive_rates

_WHERE = "rhyme_jax/rollout/slots.py"

PrefillRow = tuple[int, np.ndarray, int]  # (slot, new tokens int32[L], tokens already in its pages)


class SlotTable:
    """Decode slots, per-request outputs, waiting queue, prefix holders and stats of one call.

    Args:
      prompts: per request ``int32[p]`` prompt ids, ``None`` = skipped (overlong).
      allocator: the engine's page allocator (its slots are this table's slots).
      limit: ``max_new_tokens`` of the call (response tokens per request, prefix included).
      eos_ids: tokens that end a sequence; vocab_size: their range.
      context_width: tokens of each running sequence kept in ``tails`` (the drafter's
        ``context_width``; 0 = no drafter).
      share_prompt_prefix: fresh samples of a prompt share the pages its other live samples'
        prompt fills completely.
      prefixes: optional per request ``(tokens int32[m], logprobs f32[m])`` of a response begun
        elsewhere (``m < limit``); they start the request's output.

    Per slot (``max_slots`` rows; a free slot has ``req == -1``):
      req ``int64``: request in the slot; length ``int64``: tokens in its KV pages; pending
      ``int32``: the last sampled token, fed at position ``length`` next; order ``int64``:
      admission counter (the newest is preempted first).
      tails: ``tails.ContextTails`` of ``W = context_width`` tokens (``None`` when ``W = 0``):
      ``tails.get(ids)`` = the last ``W`` tokens of prompt + response, left-padded with -1.

    Per request (``n`` rows):
      tokens ``int32[n, limit]``, logprobs ``float32[n, limit]``, n_generated ``int64[n]`` (valid
      prefix of those rows), finish ``list[str]`` (``""`` while unfinished).

    Attributes:
      waiting: ``deque`` of request indices (queued or preempted; the head is admitted first).
      stats: the counters of ``RolloutResult.stats`` (the engine adds its pass counts).
      chunk_accepted_per_pass: draft tokens the last HistoSpec chunk accepted per pass
        (``rollout/chunk_spec.py`` sizes the next chunk's program by it);
        chunk_best_accepted: the same for the row of that chunk that emitted the most tokens (its
        tokens per pass less one), which sizes the next chunk's draft room ``Q``.

    Raises:
      EngineConfigError: a prefix has unequal token / logprob counts or is not below ``limit``.
    """

    def __init__(self, prompts: Sequence[np.ndarray | None], allocator: PageAllocator, *, limit: int,
                 eos_ids: Sequence[int], vocab_size: int, context_width: int, share_prompt_prefix: bool,
                 prefixes: Sequence | None = None):
        n, slots = len(prompts), allocator.max_slots
        self.prompts, self.allocator, self.limit = list(prompts), allocator, int(limit)
        self.page_size, self.share_prompt_prefix = allocator.page_size, bool(share_prompt_prefix)
        self.tokens = np.zeros((n, limit), np.int32)
        self.logprobs = np.zeros((n, limit), np.float32)
        self.n_generated = np.zeros(n, np.int64)
        self.finish = ["skipped" if p is None else "" for p in prompts]
        for r, (ptok, plp) in enumerate(prefixes or ()):
            m = len(ptok)
            if m >= limit or len(plp) != m:
                raise EngineConfigError(f"{_WHERE}: prefix of request {r} has {m} tokens / {len(plp)} "
                                        f"logprobs; needs equal counts below max_new_tokens={limit}")
            self.tokens[r, :m], self.logprobs[r, :m], self.n_generated[r] = ptok, plp, m
        self.eos = np.zeros(vocab_size, bool)
        self.eos[list(eos_ids)] = True
        self.waiting = deque(i for i, p in enumerate(prompts) if p is not None)
        self.req = np.full(slots, -1, np.int64)
        self.length = np.zeros(slots, np.int64)
        self.pending = np.zeros(slots, np.int32)
        self.order = np.zeros(slots, np.int64)
        self.width = int(context_width)
        self.tails = ContextTails(slots, self.width) if self.width else None
        self.admitted = 0
        self.chunk_accepted_per_pass = 0.0
        self.chunk_best_accepted = 0.0
        self.holders: dict[bytes, set[int]] = {}  # prompt bytes -> live slots holding its full pages
        self.holding: dict[int, bytes] = {}  # slot -> the prompt whose full pages it holds
        self.stats = dict(prefill_tokens=0, generated_tokens=0, decode_steps=0, prefill_steps=0,
                          preemptions=0, skipped=int(sum(p is None for p in prompts)), drafted_tokens=0,
                          accepted_tokens=0, drafting_seconds=0.0, sequence_steps=0,
                          predicted_accepted=0.0, decode_dispatches=0,
                          spec_chunk_seconds=0.0, spec_chunk_passes=0, spec_chunk_row_passes=0,
                          spec_chunks_declined=0)

    # ------------------------------------------------------------------ queries
    def live(self) -> Int[np.ndarray, "r"]:
        """``int64[r]`` ids of the occupied slots, ascending."""
        return np.flatnonzero(self.req >= 0)

    def any_live(self) -> bool:
        """Whether any slot holds a request."""
        return bool((self.req >= 0).any())

    def has_free(self) -> bool:
        """Whether any slot is free."""
        return bool((self.req < 0).any())

    def progress(self) -> Progress:
        """What the migration monitor sees now (copies)."""
        return Progress(running=self.req[self.req >= 0].copy(), waiting=np.array(self.waiting, np.int64),
                        generated=self.n_generated.copy(), decode_steps=self.stats["decode_steps"])

    # ------------------------------------------------------------------ admission
    def _context(self, r: int) -> tuple[np.ndarray, int, bytes | None, set[int] | None]:
        """Request ``r``'s prefill context (prompt, + its response so far when re-admitted), the
        pages its prompt fills completely (shareable; 0 for a re-admission or without prefix
        sharing; the last token's page stays private), the prompt's key and its live holders."""
        fresh = self.n_generated[r] == 0
        prompt = self.prompts[r]
        ctx = prompt if fresh else np.concatenate([prompt, self.tokens[r, : self.n_generated[r]]])
        full = (len(ctx) - 1) // self.page_size if fresh and self.share_prompt_prefix else 0
        pkey = prompt.tobytes() if full else None
        return ctx, full, pkey, (self.holders.get(pkey) if full else None)

    def admit(self, budget: int) -> list[PrefillRow]:
        """Seat waiting requests in free slots for one packed prefill call of at most ``budget``
        tokens, while pages last (one page is kept back for every running slot about to cross a
        page boundary, so an admission does not force a preemption at once). Pages the prompt
        fills completely are shared with a live sample of the same prompt when there is one
        (same-batch sharing is safe: every layer writes the new K/V before attending).

        Returns:
          ``[(slot, new tokens int32[L], start)]`` in admission order; ``start`` = tokens already
          in the slot's (shared) pages. Empty when the head of the queue does not fit.

        Raises:
          EngineConfigError: nothing is running and the head of the queue still does not fit.
        """
        alloc, ps = self.allocator, self.page_size
        batch, total = [], 0
        free_slots = list(np.flatnonzero(self.req < 0))
        reserve = int(((self.req >= 0) & (self.length >= alloc.num_held * ps)).sum())
        while self.waiting and free_slots:
            r = self.waiting[0]
            ctx, full, pkey, holders = self._context(r)
            shared = full if holders else 0
            new = ctx[shared * ps:]
            if total + len(new) > budget:
                break
            if not alloc.can_alloc(alloc.pages_for(len(ctx) + 1) - shared + reserve):
                break
            s = free_slots.pop(0)
            if shared:
                alloc.share(s, next(iter(holders)), shared)
            alloc.ensure(s, len(ctx))
            self.waiting.popleft()
            self.req[s], self.length[s], self.order[s] = r, len(ctx), self.admitted
            self.admitted += 1
            batch.append((s, new, shared * ps))
            total += len(new)
            if full:
                self.holders.setdefault(pkey, set()).add(s)
                self.holding[s] = pkey
            if self.tails is not None:
                self.tails.reset(s, ctx)
        if not batch and not self.any_live():  # pragma: no cover - excluded by the engine's checks
            raise EngineConfigError(f"{_WHERE}: KV pool cannot admit request {self.waiting[0]}")
        return batch

    # ------------------------------------------------------------------ pages
    def grow_pages(self) -> None:
        """Give every live slot whose next token (at position ``length``) starts a new page that
        page, oldest admission first; when the pool is dry, preempt the newest running sequence
        (possibly the one asking) until a page is free."""
        alloc = self.allocator
        needy = np.flatnonzero((self.req >= 0) & (self.length >= alloc.num_held.astype(np.int64) * self.page_size))
        for s in sorted(needy, key=lambda x: self.order[x]):
            if self.req[s] < 0:
                continue
            while not alloc.can_alloc(1):
                running = np.flatnonzero(self.req >= 0)
                victim = running[np.argmax(self.order[running])]
                self.preempt(victim)
                if victim == s:
                    break
            if self.req[s] >= 0:
                alloc.ensure(s, self.length[s] + 1)

    def release(self, s: int) -> None:
        """Free slot ``s`` and its pages (shared prefix pages stay with their other holders)."""
        self.allocator.free(s)
        self.req[s] = -1
        pkey = self.holding.pop(s, None)
        if pkey is not None:
            self.holders[pkey].discard(s)

    def preempt(self, s: int) -> None:
        """Release slot ``s`` and requeue its request at the head (re-prefilled later with its
        prompt + response so far)."""
        r = self.req[s]
        self.release(s)
        self.waiting.appendleft(int(r))
        self.stats["preemptions"] += 1

    # ------------------------------------------------------------------ outputs
    def record(self, ids: Int[np.ndarray, "b"], toks: Int[np.ndarray, "b w"], lps: Float[np.ndarray, "b w"],
               counts: Int[np.ndarray, "b"]) -> Int[np.ndarray, "b"]:
        """Append the emitted tokens of slots ``ids`` (row i: ``toks[i, :counts[i]]`` with their
        logprobs) to their requests, cut after an EOS or at ``limit``; the last kept token
        becomes the slot's pending token; the kept tokens enter the slot's tail. Finished
        requests get their finish reason (``"eos"`` / ``"length"``) and their slots are released.

        Returns:
          ``int64[b]`` tokens kept per slot (>= 1).
        """
        r = self.req[ids]
        j = self.n_generated[r]
        cols = np.arange(toks.shape[1])
        m = np.minimum(counts, self.limit - j)
        hit = self.eos[toks] & (cols < m[:, None])
        ended = hit.any(axis=1)
        m = np.where(ended, hit.argmax(axis=1) + 1, m)
        rows, at = np.nonzero(cols < m[:, None])
        self.tokens[r[rows], j[rows] + at] = toks[rows, at]
        self.logprobs[r[rows], j[rows] + at] = lps[rows, at]
        self.n_generated[r] = j + m
        self.pending[ids] = toks[np.arange(ids.size), m - 1]
        if self.tails is not None:
            self.tails.append(ids, toks, m)
        self.stats["generated_tokens"] += int(m.sum())
        for i in np.flatnonzero(ended | (j + m >= self.limit)):
            self.finish[r[i]] = "eos" if ended[i] else "length"
            self.release(int(ids[i]))
        return m

    def stop(self, reqs: Sequence[int],
             on_stop: Callable[[int, np.ndarray, np.ndarray], None] | None = None) -> None:
        """Take requests ``reqs`` away (migration): running ones are released, queued ones
        dropped; finish reason ``"migrated"``; ``on_stop(r, tokens, logprobs)`` gets each one's
        partial response (copies). Finished requests are ignored."""
        running = self.req[self.req >= 0]
        for r in reqs:
            r = int(r)
            if self.finish[r]:
                continue
            if r in running:
                self.release(int(np.flatnonzero(self.req == r)[0]))
            else:
                self.waiting.remove(r)
            self.finish[r] = "migrated"
            if on_stop is not None:
                m = self.n_generated[r]
                on_stop(r, self.tokens[r, :m].copy(), self.logprobs[r, :m].copy())

    def result(self, seconds: float) -> RolloutResult:
        """The call's ``RolloutResult`` (prompt order) after ``seconds`` of wall time."""
        stats = self.stats
        stats["forward_passes"] = stats["decode_steps"] + stats["prefill_steps"]
        stats["seconds"] = seconds
        derive_rates(stats)
        n = len(self.prompts)
        return RolloutResult(tokens=[self.tokens[i, : self.n_generated[i]].copy() for i in range(n)],
                             logprobs=[self.logprobs[i, : self.n_generated[i]].copy() for i in range(n)],
                             finish_reasons=self.finish, stats=stats)
