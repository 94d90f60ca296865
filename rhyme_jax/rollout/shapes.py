"""The rollout engine's pass programs: every shape a run compiles, from its config alone.

Pure functions (no JAX): the engine picks each step's bucket here, its warm-up compiles
``ShapePlan.programs()``, and ``rhyme-jax compile-report`` lists and times the same list, so a
run never compiles a shape outside it (tests check both).

* prefill: ``T`` packed tokens, a power of two in ``[64, prefill budget]``, one program per ``T``
  (``ShapePlan.prefill_layout``): up to ``N = min(max_slots, T)`` sequences, each cut into
  attention rows (chunks) of at most ``Q = pow2(T / N)`` tokens (at least 16, at most
  ``q_cap``), ``S = N + T / Q`` rows in all, full page-table rows. A chunk attends to its
  sequence's pages up to its own last token (every chunk's K/V is written before any attention of
  the layer), so the padded query work is at most ``S * Q <= 2 T`` for any mix of prompt lengths
  (one query tile of the longest prompt per sequence was ``N * pow2(max_prompt_len)``: 8 T on the
  demo, where most group members prefill a few tokens after the shared prompt pages).
* decode / verify (one program family): the live slots are compacted into ``S`` rows
  (``seq_buckets``); each feeds its pending token plus a draft of up to ``MAX_DRAFT`` tokens,
  packed back to back (no draft dimension in the shape). Per ``S`` a short ladder of
  ``(T, Q)`` pairs (``verify_pairs``): ``(S, 1)`` is plain decode; with drafts three packed sizes
  from ``1.5 S`` to the cap ``min(budget, 33 S)``, geometrically, with
  ``Q = min(33, T - S + 1, 2 T / S + 1)``. Which pair a step takes and how drafts are cut
  to its ``Q - 1`` (drafts are proposals, so cutting one is lossless) is
  ``rollout/allocation.py``'s choice. Page-table width ``W``: ``pages_per_seq`` and its quarters (``>= 8``), so the
  reference attention does not gather every column of short sequences.

With HistoSpec on, ``configs/gsm8k_qwen2.5_1.5b.yaml`` compiles 36 programs (6 prefill buckets x
2 widths + 3 row buckets x 2 widths x (1 decode + 3 verify pairs)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rhyme_jax.config.sections import MAX_DRAFT  # longest draft of one row in one step (re-exported)

if TYPE_CHECKING:
    from rhyme_jax.config import RunConfig

MIN_PREFILL_BUCKET = 64  # a shorter prefill costs about the same padded to 64
MIN_PREFILL_Q = 16
MIN_DECODE_WIDTH = 8
DRAFT_ROOM = 2  # a verify program's Q - 1 is at most this many times its packed tokens per row
DEFAULT_PREFILL_TOKENS = 2048


def pow2(n: int) -> int:
    """Smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()


def seq_buckets(max_slots: int, extra: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Sequence-row buckets of decode/verify steps: ``max_slots / 16``, ``/ 4`` and
    ``max_slots`` (at least 1 each), so tail steps with few live sequences run small programs,
    plus the ``extra`` buckets (``rollout.row_buckets``) up to ``max_slots``. The reference
    attention computes every row of a bucket, live or not: on the 2-core CPU one decode pass of
    the ledger config's model at 384 pages cost 2.6 ms for a 1-row bucket, 8.8 ms for 4 rows,
    18.3 ms for 8 and 48.8 ms for 16 (docs/results.md, L5), so a long response decoding alone
    or with a few others at the token cap runs far faster in a bucket of its size. ``live_pages``
    (the CPU's attention since commit bf88383) reads only the live rows' pages, so the bucket
    sets the cost of the rest of the pass (projections, MLP), not of its attention."""
    return tuple(sorted({max(1, max_slots // 16), max(1, max_slots // 4), max_slots}
                        | {int(b) for b in extra if 1 <= int(b) <= max_slots}))


def seq_bucket(num_active: int, max_slots: int, extra: tuple[int, ...] = ()) -> int:
    """Smallest of ``seq_buckets(max_slots, extra)`` holding ``num_active`` sequences."""
    return next(b for b in seq_buckets(max_slots, extra) if b >= num_active)


def decode_widths(pages_per_seq: int) -> tuple[int, ...]:
    """Page-table widths of decode/verify steps: ``pages_per_seq`` and its quarters, sixteenths,
    ... (rounded up) while ``>= MIN_DECODE_WIDTH``; ascending."""
    out, w = {int(pages_per_seq)}, int(pages_per_seq)
    while -(-w // 4) >= MIN_DECODE_WIDTH:
        w = -(-w // 4)
        out.add(w)
    return tuple(sorted(out))


def verify_pairs(num_rows: int, budget: int, spec: bool = True) -> tuple[tuple[int, int], ...]:
    """``(T, Q)`` pairs of the decode/verify steps of ``num_rows`` rows, ascending in both:
    ``(S, 1)`` (plain decode) and, with ``spec``, three packed sizes from ``lo = max(S + 1, 1.5 S)``
    to the cap ``max(S, min(budget, 33 S))``, geometrically (``lo``, their geometric mean rounded
    up to a multiple of 8, the cap), so a step pads at most about ``sqrt(cap / lo)`` times its
    tokens. ``Q = min(33, T - S + 1, 2 T / S + 1)``: no draft longer than twice the mean room
    per row (``DRAFT_ROOM``). The reference attention lays such steps out per sequence, with work
    that grows with ``S * Q``. On the 2-core CPU one demo layer at ``(S, T) = (128, 512)`` took
    4.1 ms at ``Q = 9`` and 8.0 ms at ``Q = 17``; that whole program ran at 26.5 ms where it had
    been profiled at 32.5 ms, and it emitted 17.1 tokens per ms against 10.7 for plain decode
    (``python -m benchmarks.attention_layout``; issue 16 note)."""
    s = int(num_rows)
    pairs = [(s, 1)]
    cap = max(s, min(int(budget), s * (MAX_DRAFT + 1)))
    if not spec or cap == s:
        return tuple(pairs)
    lo = min(cap, max(s + 1, -(-3 * s // 2)))
    mid = min(cap, -(-int(round(math.sqrt(lo * cap))) // 8) * 8)
    for t in sorted({lo, mid, cap}):
        if t > s:
            pairs.append((t, min(MAX_DRAFT + 1, t - s + 1, DRAFT_ROOM * t // s + 1)))
    return tuple(pairs)


@dataclass(frozen=True, order=True)
class PassShape:
    """One compiled pass program.

    Attributes:
      kind: ``"prefill"``, ``"decode"`` (``Q = 1``), ``"verify"`` (drafts packed), ``"chunk"``
        (``ShapePlan.passes`` decode passes of ``S`` rows in one program, ``rollout/chunk.py``) or
        ``"spec_chunk"`` (as many verify passes of ``(S, T, Q)`` drafting on the device,
        ``rollout/chunk_spec.py``).
      tokens: ``T``, packed tokens (``tokens/positions i32[T]``).
      rows: ``S``, sequence rows (``kv_lens i32[S]``, ``cu_q_lens i32[S+1]``).
      q_len: static ``max_q_len`` of the attention.
      width: page-table columns (``page_indices i32[S, width]``).
    """

    kind: str
    tokens: int
    rows: int
    q_len: int
    width: int


@dataclass(frozen=True)
class ShapePlan:
    """Every bucket of one engine (see the module docstring); build it with ``plan``."""

    max_slots: int
    pages_per_seq: int
    prefill_budget: int
    q_cap: int
    verify_budget: int
    passes: int = 1  # decode passes per dispatch (``rollout/chunk.py``); > 1 adds the "chunk" programs
    row_buckets: tuple[int, ...] = ()  # extra sequence-row buckets (``seq_buckets``)

    def buckets(self) -> tuple[int, ...]:
        """The decode/verify row buckets: ``seq_buckets(max_slots, row_buckets)``."""
        return seq_buckets(self.max_slots, self.row_buckets)

    def bucket(self, num_active: int) -> int:
        """Smallest row bucket holding ``num_active`` sequences."""
        return seq_bucket(num_active, self.max_slots, self.row_buckets)

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        """Prefill token buckets ``T``: powers of two from ``MIN_PREFILL_BUCKET`` (64) to the prefill budget."""
        return tuple(1 << i for i in range(MIN_PREFILL_BUCKET.bit_length() - 1, self.prefill_budget.bit_length()))

    def prefill_layout(self, t_b: int) -> tuple[int, int]:
        """``(S, Q)`` of prefill bucket ``t_b``: attention rows and their ``max_q_len`` (chunk
        length). ``N = min(max_slots, t_b)`` sequences of ``n_i`` tokens (``sum n_i <= t_b``) need
        ``sum ceil(n_i / Q) < t_b / Q + N`` chunks, so ``S = N + t_b // Q`` always holds them."""
        n = min(self.max_slots, t_b)
        q = min(self.q_cap, t_b, max(MIN_PREFILL_Q, pow2(-(-t_b // n))))
        return n + t_b // q, q

    @property
    def widths(self) -> tuple[int, ...]:
        return decode_widths(self.pages_per_seq)

    def prefill_shape(self, total: int) -> tuple[int, int, int]:
        """``(T, S, Q)`` of a prefill packing ``total`` tokens (``prefill_layout`` of its bucket)."""
        t_b = max(MIN_PREFILL_BUCKET, pow2(total))
        return (t_b, *self.prefill_layout(t_b))

    def width(self, max_pages_held: int) -> int:
        """Smallest width holding ``max_pages_held`` page-table columns."""
        return next(w for w in self.widths if w >= min(max_pages_held, self.pages_per_seq))

    def pass_pair(self, num_rows: int, used: int) -> tuple[int, int]:
        """``(T, Q)`` of a decode/verify step of ``num_rows`` rows packing ``used`` tokens.

        Raises:
          ValueError: ``used`` exceeds the cap of the row bucket.
        """
        pairs = verify_pairs(num_rows, self.verify_budget)
        for t, q in pairs:
            if t >= used:
                return t, q
        raise ValueError(f"step packs {used} tokens, more than the cap {pairs[-1][0]} of {num_rows} rows")

    def programs(self, spec: bool = True) -> list[PassShape]:
        """Every pass program of a run (prefill, decode, with ``spec`` verify, and with ``passes > 1``
        the plain decode chunks of ``rollout/chunk.py``, one per row bucket and width), sorted."""
        out = [PassShape("prefill", t, *self.prefill_layout(t), w) for t in self.prefill_buckets for w in self.widths]
        for s in self.buckets():
            for t, q in verify_pairs(s, self.verify_budget, spec):
                out += [PassShape("decode" if q == 1 else "verify", t, s, q, w) for w in self.widths]
            if self.passes > 1:
                out += [PassShape("chunk", s, s, 1, w) for w in self.widths]
                if spec:  # HistoSpec chunks (rollout/chunk_spec.py) run the verify pairs' shapes
                    out += [PassShape("spec_chunk", t, s, q, w) for t, q in verify_pairs(s, self.verify_budget)
                            if q > 1 for w in self.widths]
        return sorted(set(out))


def plan(*, max_slots: int, page_size: int, max_prompt_len: int, max_new_tokens: int,
         max_prefill_tokens: int = DEFAULT_PREFILL_TOKENS, max_verify_tokens: int = 0,
         passes_per_dispatch: int = 1, row_buckets: tuple[int, ...] = ()) -> ShapePlan:
    """The buckets of an engine with these sizes (``RolloutEngine`` arguments; 0 = default)."""
    max_seq_len = int(max_prompt_len) + int(max_new_tokens)
    max_prefill_len = max_seq_len - 1  # a preempted sequence re-prefills all but its last token
    q_cap = pow2(max_prefill_len)
    return ShapePlan(
        max_slots=int(max_slots), pages_per_seq=-(-max_seq_len // int(page_size)),
        prefill_budget=max(pow2(max_prefill_tokens), pow2(max_prefill_len), MIN_PREFILL_BUCKET),
        q_cap=q_cap,
        verify_budget=max(int(max_slots), int(max_verify_tokens) or 4 * int(max_slots)),
        passes=max(1, int(passes_per_dispatch)), row_buckets=tuple(sorted({int(b) for b in row_buckets})))


def plan_from_config(cfg: RunConfig) -> ShapePlan:
    """``plan`` of a run config's ``rollout`` section (the engine the trainer builds)."""
    r = cfg.rollout
    return plan(max_slots=r.max_slots, page_size=r.page_size, max_prompt_len=r.max_prompt_len,
                max_new_tokens=r.max_new_tokens, max_verify_tokens=r.max_verify_tokens,
                passes_per_dispatch=r.passes_per_dispatch, row_buckets=tuple(r.row_buckets))


def programs_from_config(cfg: RunConfig) -> list[PassShape]:
    """Step programs a run compiles: ``plan_from_config(cfg).programs(spec=cfg.spec.enabled)``."""
    return plan_from_config(cfg).programs(spec=bool(cfg.spec.enabled))
