"""A packed minibatch in buffers of several lengths: the update's attention follows each row's length.

``packing.pack_minibatch`` lays a minibatch into buffers as long as its longest row, and the
update's attention is dense within a buffer (``Decoder.hidden`` masks by segment), so with a long
tail one 4,000-token response makes every buffer cost ``T^2`` per head and layer, whatever it
holds. Here (``grpo.pack_lengths``) each buffer takes the length of a class
(``[256, 512, ..., 8192]``, the config's): rows are placed longest first, each into the first
open buffer with room, else into a new buffer of the smallest class that holds it. Attention
then costs about ``sum_i L_i x class(L_i)`` instead of ``B' x T^2``, the cost a variable-length
kernel has on an accelerator (verl ``use_remove_padding`` over FlashAttention's varlen API).

Each class's buffers are cut into calls of a fixed number of rows (``call_rows``:
``grpo.micro_batch_tokens // length`` per device, at least one), the last call of a class
rounded up to a power of two, so a run compiles a few programs per class; the gradient is
accumulated over the calls and applied once (``train/accumulate.py``). The loss weights are
computed over the whole padded minibatch before any split (``packing.target_grid``), so the
accumulated loss and gradient equal the padded update's (``tests/test_length_classes.py``).
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Int

from rhyme_jax.train.packing import fill_buffers, first_fit, pack_minibatch, target_grid


def place_in_classes(lengths: Int[np.ndarray, "B"], classes: list[int]) -> list[tuple[int, list[int]]]:
    """Rows into buffers of the class lengths: longest row first, into the first open buffer
    with room, else into a new buffer of the smallest class ``>=`` its length.

    Args:
      lengths: i64[B] tokens of each row (0 = an empty row, left out).
      classes: buffer lengths, increasing.

    Returns:
      ``(length, rows)`` per buffer, in opening order.

    Raises:
      ValueError: a row is longer than the largest class.
    """
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and int(lengths.max()) > classes[-1]:
        raise ValueError(f"packing: a row of {int(lengths.max())} tokens exceeds the largest of "
                         f"grpo.pack_lengths ({classes[-1]})")
    return first_fit(lengths, lambda n: next(c for c in classes if c >= n))


def call_rows(buffers: int, full: int, multiple: int) -> list[int]:
    """Rows of each call for ``buffers`` buffers of one class: calls of ``full`` rows, then one
    of the rest rounded up to ``multiple`` times a power of two (at most ``full``)."""
    calls = [full] * (buffers // full)
    rest = buffers - sum(calls)
    if rest:
        units = -(-rest // multiple)
        calls.append(min(full, multiple * (1 << (units - 1).bit_length())))
    return calls


def pack_by_length(batch: dict[str, np.ndarray], loss_agg: str, classes: list[int], call_tokens: int,
                   multiple: int = 1, skip_zero_advantage: bool = False) -> list[dict[str, np.ndarray]]:
    """Pack a right-padded minibatch into calls of class-length buffers (module docstring).

    Args:
      batch: the padded minibatch ``packing.pack_minibatch`` takes.
      loss_agg: the aggregation (``losses.LOSS_AGGS``), applied over the whole minibatch.
      classes: buffer lengths (``grpo.pack_lengths``), increasing.
      call_tokens: tokens of one call per device (``grpo.micro_batch_tokens``; 0 = the largest
        class): a class of length ``L`` runs ``max(1, call_tokens // L) x multiple`` rows a call.
      multiple: the batch shards; every call's rows are a multiple of it.
      skip_zero_advantage: also leave rows of advantage 0 out (``packing.target_grid``; rows
        without loss tokens always stay out).

    Returns:
      the calls, shortest class first: each a packed minibatch (``pack_minibatch``'s fields,
      ``[rows, L]`` and ``[rows, L - 1]``) whose padding buffers have no tokens and zero weights.

    Raises:
      losses.LossInputError: unknown ``loss_agg`` or a normalised one without ``loss_norm``.
      ValueError: a row longer than the largest class.
    """
    grid, lengths = target_grid(batch, loss_agg, skip_zero_advantage)
    budget = call_tokens or classes[-1]
    by_class: dict[int, list[list[int]]] = {}
    for size, rows in place_in_classes(lengths, classes):
        by_class.setdefault(size, []).append(rows)
    calls = []
    for size in sorted(by_class):
        bins, full = by_class[size], max(1, budget // size) * multiple
        start = 0
        for rows in call_rows(len(bins), full, multiple):
            part = bins[start:start + rows]
            calls.append(fill_buffers(batch, grid, lengths, part, rows, size))
            start += len(part)
    return calls



def update_calls(batch: dict[str, np.ndarray], grpo, multiple: int = 1) -> list[dict[str, np.ndarray]]:
    """The jitted calls of one optimizer step's right-padded minibatch as the ``grpo`` config section
    lays them out: ``pack_by_length`` calls with ``grpo.pack_lengths``, else one packed minibatch
    (``packing.pack_minibatch``) with ``grpo.padding_free``, else the padded minibatch itself. Packed,
    rows that carry no gradient stay out (``grpo.skip_zero_advantage_rows``; ``packing.target_grid``).
    ``multiple``: the batch shards. Raises as ``pack_by_length`` and ``pack_minibatch``."""
    skip = grpo.skip_zero_advantage_rows
    if grpo.pack_lengths:
        return pack_by_length(batch, grpo.loss_agg, list(grpo.pack_lengths), grpo.micro_batch_tokens, multiple, skip)
    return [pack_minibatch(batch, grpo.loss_agg, multiple=multiple, skip_zero_advantage=skip)
            if grpo.padding_free else batch]
