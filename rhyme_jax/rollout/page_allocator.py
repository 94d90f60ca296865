"""Host-side page allocator: a free list over the KV pool and one page table per engine slot.

Page 0 is reserved scratch and never allocated. A page is owned by one slot, or shared read-only by
several slots holding the same prompt prefix (``share``; vLLM-style prefix sharing for the n samples
of a GRPO group): each page carries a reference count and returns to the free list when the last
slot holding it is freed. ``check`` verifies the invariants (used by tests after every step).
"""

from __future__ import annotations

import numpy as np


class PageAllocationError(RuntimeError):
    """Allocator misuse: slot out of range, more pages than a page table row, or pool empty."""


class PageAllocator:
    """Free list of KV pages and per-slot page tables.

    Attributes:
      page_table: ``np.int32[max_slots, pages_per_seq]``; row ``s`` lists slot ``s``'s pages in
        order, unused entries are 0 (the scratch page).
      num_held: ``np.int32[max_slots]`` pages currently held per slot.
    """

    def __init__(self, num_pages: int, page_size: int, max_slots: int, pages_per_seq: int):
        if num_pages < 2:
            raise PageAllocationError(
                f"rhyme_jax/rollout/page_allocator.py: num_pages must be >= 2 (page 0 is scratch), got {num_pages}")
        if page_size < 1 or max_slots < 1 or pages_per_seq < 1:
            raise PageAllocationError(
                "rhyme_jax/rollout/page_allocator.py: page_size, max_slots, pages_per_seq must be >= 1, "
                f"got {page_size}, {max_slots}, {pages_per_seq}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_slots = max_slots
        self.pages_per_seq = pages_per_seq
        self.page_table = np.zeros((max_slots, pages_per_seq), np.int32)
        self.num_held = np.zeros(max_slots, np.int32)
        self._refs = np.zeros(num_pages, np.int64)  # slots holding each page
        self._free: list[int] = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        """Pages available for allocation."""
        return len(self._free)

    def pages_for(self, num_tokens):
        """Pages needed to hold ``num_tokens`` tokens (an int, or element-wise over an int array)."""
        if np.ndim(num_tokens):
            return -(-np.asarray(num_tokens, np.int64) // self.page_size)
        return -(-int(num_tokens) // self.page_size)

    def can_alloc(self, num_pages: int) -> bool:
        """Whether ``num_pages`` more pages are free."""
        return num_pages <= len(self._free)

    def ensure(self, slot: int, num_tokens: int) -> None:
        """Grow slot ``slot``'s page table so it covers ``num_tokens`` tokens.

        Raises:
          PageAllocationError: slot out of range, ``num_tokens`` exceeds the page table row, or
            not enough free pages (nothing is allocated then).
        """
        if not 0 <= slot < self.max_slots:
            raise PageAllocationError(f"page_allocator: slot {slot} out of range [0, {self.max_slots})")
        need = self.pages_for(num_tokens)
        if need > self.pages_per_seq:
            raise PageAllocationError(
                f"page_allocator: slot {slot} needs {need} pages for {num_tokens} tokens, "
                f"page table row holds {self.pages_per_seq}")
        held = int(self.num_held[slot])
        extra = need - held
        if extra <= 0:
            return
        if extra > len(self._free):
            raise PageAllocationError(
                f"page_allocator: slot {slot} needs {extra} more pages, only {len(self._free)} free")
        for i in range(held, need):
            page = self._free.pop()
            if self._refs[page] != 0:  # pragma: no cover - invariant guard
                raise PageAllocationError(f"page_allocator: free page {page} is still held")
            self._refs[page] = 1
            self.page_table[slot, i] = page
        self.num_held[slot] = need

    def share(self, slot: int, src: int, num_pages: int) -> None:
        """Give empty slot ``slot`` the first ``num_pages`` pages of slot ``src`` (read-only
        prefix: neither slot may write into them afterwards).

        Raises:
          PageAllocationError: a slot is out of range, ``slot`` already holds pages, or ``src``
            holds fewer than ``num_pages``.
        """
        for name, x in (("slot", slot), ("src", src)):
            if not 0 <= x < self.max_slots:
                raise PageAllocationError(f"page_allocator: {name} {x} out of range [0, {self.max_slots})")
        if self.num_held[slot] or slot == src:
            raise PageAllocationError(f"page_allocator: slot {slot} must be empty to share a prefix")
        if not 0 <= num_pages <= self.num_held[src]:
            raise PageAllocationError(
                f"page_allocator: slot {src} holds {self.num_held[src]} pages, cannot share {num_pages}")
        pages = self.page_table[src, :num_pages]
        self.page_table[slot, :num_pages] = pages
        self._refs[pages] += 1
        self.num_held[slot] = num_pages

    def free(self, slot: int) -> int:
        """Release ``slot``'s pages (a page returns to the free list when no slot holds it any
        more); returns how many pages the slot held."""
        held = int(self.num_held[slot])
        pages = self.page_table[slot, :held]
        for page in pages[::-1]:
            if self._refs[page] < 1:  # pragma: no cover - invariant guard
                raise PageAllocationError(f"page_allocator: slot {slot} frees page {page} nobody holds")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(int(page))
        self.page_table[slot, :] = 0
        self.num_held[slot] = 0
        return held

    def check(self) -> None:
        """Assert the invariants: every held page's reference count equals the number of slots
        holding it, a slot never holds a page twice, shared pages form a common prefix of the
        slots holding them, page 0 is never held, free list consistent, nothing leaked.

        Raises:
          PageAllocationError: an invariant is broken.
        """
        used = [self.page_table[s, : self.num_held[s]] for s in range(self.max_slots)]
        flat = np.concatenate(used) if used else np.zeros(0, np.int32)
        if (flat == 0).any():
            raise PageAllocationError("page_allocator: scratch page 0 assigned to a sequence")
        if any(len(np.unique(u)) != len(u) for u in used):
            raise PageAllocationError("page_allocator: a slot holds a page twice")
        counts = np.bincount(flat, minlength=self.num_pages)
        if not np.array_equal(counts, self._refs):
            raise PageAllocationError("page_allocator: reference counts disagree with the page tables")
        for page in np.flatnonzero(counts > 1):  # shared pages: same position in every holder
            where = {int(np.flatnonzero(u == page)[0]) for u in used if (u == page).any()}
            if len(where) != 1:
                raise PageAllocationError(f"page_allocator: shared page {page} is not a common prefix")
        if set(flat.tolist()) & set(self._free) or len(set(self._free)) != len(self._free):
            raise PageAllocationError("page_allocator: a page is both free and assigned (or free twice)")
        if len(np.unique(flat)) + len(self._free) != self.num_pages - 1:
            raise PageAllocationError("page_allocator: pages leaked")
