"""Several plain decode passes per dispatch: a chunk of up to ``N`` passes in one jitted loop.

Per decode pass the per-pass engine spends about a millisecond on the host outside the device
call on a CPU demo (building the packed inputs, dispatching, fetching, recording, page growth;
issue 50). A chunk moves the loop of ``N = rollout.passes_per_dispatch`` plain decode passes onto
the device: ``decode_chunk`` is a ``jax.lax.while_loop`` over the engine's own decode pass
(``passes.verify_pass`` with one token per row), carrying the donated KV pool, each row's pending
token, position, emitted count and done flag. The host reserves up front the pages of ``N``
more tokens per row (at most the row's remaining budget), dispatches once, fetches
``tokens / logprobs [N, S]`` and the per-row counts once, and records them once.

Rows that finish inside the chunk (EOS, or the request's ``max_new_tokens``) are masked: from
the next pass on they write scratch page 0 and their positions are not emitted; their slots are
released and refilled at the chunk's end. The loop stops early when every row is done.

What ``N`` trades: host time per pass falls as ``1 / N``; a row that finishes mid-chunk idles
for the rest of the chunk (its slot is refilled only at the chunk's end: up to ``N - 1`` wasted
row-passes per finished row), and each row holds the pages of up to ``N`` tokens ahead
(``ceil(N / page_size)`` pages more than the per-pass engine at most), which admission cannot
use meanwhile. When the pool cannot give a chunk's pages without preempting anyone, the engine
runs that step as a per-pass decode (which preempts as usual).

Tokens: each draw is keyed by ``(request, position)`` (``sampling.position_noise``) inside the
same pass function, so a chunked rollout emits the per-pass engine's tokens with the same key.
Chunks are used for plain decode only (no drafter, or an idle one); HistoSpec steps stay per pass.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from rhyme_jax.rollout.forward import RaggedMeta
from rhyme_jax.rollout.passes import StaticModel, verify_pass
from rhyme_jax.rollout.shapes import PassShape


@dataclass
class ChunkInputs:
    """Host arguments of one ``decode_chunk`` call of ``S`` rows (the first ``num_live`` are
    engine slots ``slots``, the rest padding): ``pending i32[S]`` token each row feeds first,
    ``positions i32[S]`` its position (tokens already in the KV pool), ``pages i32[S, W]`` page-table
    rows, ``streams i32[S]`` the request of each row (keys its draws), ``budgets i32[S]`` tokens
    the row may still emit, ``eos i32[E]`` stop tokens (-1 = none), ``passes`` the most passes
    to run (``<= max_passes``, the static ``N``)."""

    pending: np.ndarray
    positions: np.ndarray
    pages: np.ndarray
    streams: np.ndarray
    budgets: np.ndarray
    eos: np.ndarray
    num_live: int
    passes: int
    max_passes: int
    slots: np.ndarray

    def pass_shape(self) -> PassShape:
        """The ``shapes.PassShape`` of kind ``"chunk"`` this call runs."""
        rows, width = self.pages.shape
        return PassShape("chunk", rows, rows, 1, width)


@functools.partial(jax.jit, static_argnums=(0,),
                   static_argnames=("max_passes", "page_size", "mode", "attention_impl", "mesh"), donate_argnums=(2,))
def decode_chunk(static: StaticModel, leaves, kv, pending: Int[Array, "S"], positions: Int[Array, "S"],
                 pages: Int[Array, "S W"], streams: Int[Array, "S"], budgets: Int[Array, "S"],
                 eos: Int[Array, "E"], num_live: Int[Array, ""], passes: Int[Array, ""], key,
                 temperature: Float[Array, ""], top_k: Int[Array, ""], top_p: Float[Array, ""], *,
                 max_passes: int, page_size: int, mode: str, attention_impl: str, mesh=None):
    """Up to ``passes`` plain decode passes of ``S`` rows in one ``while_loop`` (module docstring).

    Pass ``i`` is ``passes.verify_pass`` with one token per row over exactly the inputs the
    per-pass engine builds for these rows (``batching.verify_inputs`` with no drafts; rows past
    ``num_live`` are padding), except that a row done before pass ``i`` writes scratch page 0 and
    attends to its ``positions`` written tokens. A row is done after emitting an ``eos`` token or
    ``budgets`` tokens; the loop ends after ``passes`` passes or when every row is done.

    Returns:
      ``(tokens i32[N, S], behaviour logprobs f32[N, S], emitted i32[S], passes run i32[],
      updated kv)``: row ``s`` emitted ``tokens[:emitted[s], s]``.
    """
    rows = pending.shape[0]
    width = pages.shape[1]
    idx = jnp.arange(rows, dtype=jnp.int32)
    is_row = idx < num_live
    cu = jnp.minimum(jnp.arange(rows + 1, dtype=jnp.int32), num_live).astype(jnp.int32)
    num_seqs = jnp.reshape(num_live, (1,)).astype(jnp.int32)
    streams = jnp.where(is_row, streams, 0)
    pages = jnp.where(is_row[:, None], pages, 0)

    def cond(c):
        i, done = c[0], c[4]
        return (i < passes) & ~jnp.all(done)

    def body(c):
        i, kv, tok, pos, done, count, out_t, out_l = c
        live = ~done
        col = jnp.clip(pos // page_size, 0, width - 1)
        page = jnp.take_along_axis(pages, col[:, None], axis=1)[:, 0]
        meta = RaggedMeta(kv_lens=jnp.where(is_row, pos + live.astype(jnp.int32), 0), page_indices=pages,
                          cu_q_lens=cu, num_seqs=num_seqs,
                          slot_mapping=jnp.where(live, page * page_size + pos % page_size, 0))
        t, lp, _, kv = verify_pass(static, leaves, kv, jnp.where(is_row, tok, 0), jnp.where(is_row, pos, 0), meta,
                                   streams, key, temperature, top_k, top_p, max_q_len=1, mode=mode,
                                   attention_impl=attention_impl, mesh=mesh)
        out_t = out_t.at[i].set(t[:rows])
        out_l = out_l.at[i].set(lp[:rows])
        step = live.astype(jnp.int32)
        count = count + step
        stop = jnp.any(t[:rows, None] == eos[None, :], axis=1) | (count >= budgets)
        return (i + 1, kv, jnp.where(live, t[:rows], tok), pos + step, done | (live & stop), count, out_t, out_l)

    init = (jnp.int32(0), kv, pending, positions, ~is_row, jnp.zeros(rows, jnp.int32),
            jnp.zeros((max_passes, rows), jnp.int32), jnp.zeros((max_passes, rows), jnp.float32))
    i, kv, _, _, _, count, out_t, out_l = jax.lax.while_loop(cond, body, init)
    return out_t, out_l, count, i, kv


def call(engine, flat_state, inp: ChunkInputs, key, scalars, mode):
    """``(jitted function, positional args, keyword args)`` of ``inp`` for ``engine``
    (``RolloutEngine._call``)."""
    leaves, static = flat_state
    kw = dict(max_passes=inp.max_passes, page_size=engine.page_size, mode=mode, attention_impl=engine.attention_impl,
              mesh=engine.mesh)
    return decode_chunk, (static, leaves, engine.kv, inp.pending, inp.positions, inp.pages, inp.streams, inp.budgets,
                          inp.eos, np.int32(inp.num_live), np.int32(inp.passes), key, *scalars), kw


def eos_array(eos_ids) -> np.ndarray:
    """``i32[E]`` stop tokens of a chunk (``[-1]``: none, so ``E >= 1`` and the program is fixed)."""
    return np.array(list(eos_ids) or [-1], np.int32)


def dummy_inputs(shape: PassShape, engine) -> ChunkInputs:
    """Inputs of a ``"chunk"`` program with no live row (warm-up: compiles it, runs no pass)."""
    z = np.zeros(shape.rows, np.int32)
    return ChunkInputs(z, z, np.zeros((shape.rows, shape.width), np.int32), z, z, eos_array(engine.eos_ids), 0, 0,
                       engine.plan.passes, np.zeros(0, np.int64))


def reserve(table, ids: np.ndarray, passes: int) -> np.ndarray | None:
    """Give every slot of ``ids`` the pages of its next ``min(passes, remaining budget)`` tokens,
    if the pool has them all without preempting anyone. Returns the remaining budgets
    (``int64[n]``), or ``None`` (nothing allocated) when the pool is short."""
    alloc = table.allocator
    rem = table.limit - table.n_generated[table.req[ids]]
    upto = table.length[ids] + np.minimum(passes, rem)
    need = alloc.pages_for(upto) - alloc.num_held[ids]
    if not alloc.can_alloc(int(need[need > 0].sum())):
        return None
    for i in np.flatnonzero(need > 0):
        alloc.ensure(int(ids[i]), int(upto[i]))
    return rem


def inputs(engine, table, ids: np.ndarray, budgets: np.ndarray) -> ChunkInputs:
    """The ``ChunkInputs`` of live slots ``ids`` (pages reserved by ``reserve``)."""
    n, alloc = ids.size, engine.allocator
    rows = engine.plan.bucket(n)
    width = engine.table_width(ids)

    def pad(values, dtype=np.int32):
        out = np.zeros(rows, dtype)
        out[:n] = values
        return out

    pages = np.zeros((rows, width), np.int32)
    pages[:n] = alloc.page_table[ids, :width]
    return ChunkInputs(pad(table.pending[ids]), pad(table.length[ids]), pages, pad(table.req[ids]), pad(budgets),
                       eos_array(engine.eos_ids), n, engine.plan.passes, engine.plan.passes, ids)


def decode(engine, table, run) -> bool:
    """One chunk of plain decode passes over the live slots of ``table`` through ``run`` (the
    engine's ``_Passes``): reserve pages, run, record every row's emitted tokens (finished rows
    are released). Returns False, having done nothing, when the pool cannot hold the chunk."""
    return decode_tokens(engine, table, run) is not None


def decode_tokens(engine, table, run) -> tuple[np.ndarray, np.ndarray] | None:
    """``decode``, returning what the chunk's live rows (``table.live()`` before it, in order)
    emitted: ``(tokens int32[n, N], count int64[n])``, row ``i``'s tokens ``tokens[i, :count[i]]``
    (before the EOS / budget cut of ``record``); None where ``decode`` returns False."""
    ids = table.live()
    budgets = reserve(table, ids, engine.plan.passes)
    if budgets is None:
        return None
    inp = inputs(engine, table, ids, budgets)
    toks, lps, count, n_run = run(inp)
    n = ids.size
    count = np.asarray(count[:n], np.int64)
    table.stats["decode_steps"] += int(n_run)
    table.stats["decode_dispatches"] += 1
    table.stats["sequence_steps"] += int(count.sum())
    toks = np.asarray(toks)[:, :n].T
    table.length[ids] += table.record(ids, toks, np.asarray(lps)[:, :n].T, count)
    return toks, count

