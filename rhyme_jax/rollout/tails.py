"""The drafter's view of each running sequence: its last ``W`` tokens, kept in a sliding buffer.

Every decode step appends each row's emitted tokens; the drafter reads the last ``W`` tokens of
the rows it drafts for. Shifting a ``[slots, W]`` window every step costs a full copy of it
(with ``W = 256`` for self-lookup and 256 rows, 0.24 ms a step on a 2-core CPU, about 1.5% of a
demo decode pass). Here each slot owns a row of ``2 W + slack`` tokens: an append writes only the
new tokens at the row's end pointer, a read is one strided window view, and a row is moved back to
the front only when it runs out of room (once every ``W + slack`` tokens or so).
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Int
from numpy.lib.stride_tricks import sliding_window_view

_WHERE = "rhyme_jax/rollout/tails.py"
SLACK = 64  # tokens of room past 2 W; one append may add at most W + SLACK tokens


class ContextTails:
    """Last ``width`` tokens of prompt + response of every decode slot, left-padded with -1.

    Args:
      slots: decode slots (rows).
      width: ``W``, tokens kept per slot (>= 1).

    Attributes:
      buf: ``int32[slots, 2 W + SLACK]``; slot ``s``'s tail is ``buf[s, end[s] - W : end[s]]``.
      end: ``int64[slots]`` end pointers (``>= W``).
    """

    def __init__(self, slots: int, width: int):
        if width < 1:
            raise ValueError(f"{_WHERE}: tail width must be >= 1, got {width}")
        self.width = int(width)
        self.buf = np.full((slots, 2 * self.width + SLACK), -1, np.int32)
        self.end = np.full(slots, self.width, np.int64)
        self._windows = sliding_window_view(self.buf, self.width, axis=1)  # a view of buf, made once

    def reset(self, s: int, ctx: Int[np.ndarray, "c"]) -> None:
        """Slot ``s`` now holds a sequence whose tokens so far are ``ctx`` (prompt + response)."""
        w = self.width
        self.buf[s, :w] = np.concatenate([np.full(w, -1, np.int32), np.asarray(ctx, np.int32)])[-w:]
        self.end[s] = w

    def append(self, ids: Int[np.ndarray, "b"], toks: Int[np.ndarray, "b k"], counts: Int[np.ndarray, "b"]) -> None:
        """Append ``toks[i, :counts[i]]`` to slot ``ids[i]``'s tail (``counts <= W + SLACK``).

        Raises:
          ValueError: a count is above ``W + SLACK``.
        """
        w, cap = self.width, self.buf.shape[1]
        counts = np.asarray(counts, np.int64)
        if counts.size and counts.max() > cap - w:
            raise ValueError(f"{_WHERE}: cannot append {counts.max()} tokens at once (at most {cap - w})")
        end = self.end[ids]
        for i in np.flatnonzero(end + counts > cap):  # out of room: move the window to the front
            s = ids[i]
            self.buf[s, :w] = self.buf[s, end[i] - w:end[i]]
            end[i] = w
        rows, at = np.nonzero(np.arange(toks.shape[1]) < counts[:, None])
        self.buf[ids[rows], end[rows] + at] = toks[rows, at]
        self.end[ids] = end + counts

    def get(self, ids: Int[np.ndarray, "b"]) -> Int[np.ndarray, "b w"]:
        """``int32[b, W]`` tails of slots ``ids`` (a copy)."""
        return self._windows[ids, self.end[ids] - self.width]
