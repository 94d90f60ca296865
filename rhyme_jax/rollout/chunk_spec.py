"""HistoSpec inside a chunk: up to ``N`` verify passes per dispatch, each drafting on the device.

The per-pass HistoSpec engine asks the host drafter for drafts before every pass and records
the tokens after it: about a millisecond of host work per pass on a CPU (issue 50), a stall
between passes on an accelerator. Here ``spec_chunk`` runs ``N = rollout.passes_per_dispatch``
verify passes in one ``jax.lax.while_loop``. Before the chunk the host builds each row's history
(``Drafter``'s ``history_rows``: the prompt's previous rollouts; plus the current tails of its
siblings) into a padded ``int32[S, H]`` tensor and passes the row's own last ``C`` tokens; before
every pass the device drafts from them (``device_drafts.lookup_drafts``), packs
``[pending + draft]`` of every row into the program's ``T`` tokens (drafts cut first come first
served to fit), runs ``passes.verify_pass`` and appends the emitted tokens to the row's context.

Between chunks the host drafter does what needs the host: it drafts once with its suffix index
and goodput sizing, and ``allocation.choose_pass`` says whether a draft pays now (a plain chunk,
``rollout/chunk.py``, when none does); ``decode`` sizes the program ``(S, T, Q)`` the whole chunk
runs from that choice and the last chunk's outcome, under the engine's ``SpecGuard``. The
drafter's calibration is not fed from inside a chunk.

Tokens: every draw is keyed by ``(request, position)`` and a draft token is accepted exactly when
it is the token plain sampling draws there (``verification.verify_packed``), so the chunk emits
the per-pass engine's tokens with the same key, whatever it drafts. Pages: each row reserves the
pages of ``min(N * Q, budget)`` tokens before the chunk (drafts never write past the row's
budget); rows that finish leave at the chunk's end, as in ``rollout/chunk.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from rhyme_jax.rollout import chunk
from rhyme_jax.rollout.device_drafts import append_tokens, fit_to_budget, lookup_drafts
from rhyme_jax.rollout.forward import RaggedMeta
from rhyme_jax.rollout.passes import StaticModel, verify_pass
from rhyme_jax.rollout.shapes import PassShape, verify_pairs
from rhyme_jax.rollout.spec_guard import TRIAL_PASSES

CONTEXT = 256  # C: own tokens of each row searched on the device (the host drafter's self-lookup width)


@dataclass
class SpecChunkInputs:
    """Host arguments of one ``spec_chunk`` call: ``ChunkInputs`` of the same rows (``base``) plus
    ``history i32[S, H]`` and ``context i32[S, C]`` (-1 = no token), the program's packed tokens
    ``tokens`` (``T``) and ``q_len`` (``Q``: drafts of at most ``Q - 1``), and the drafter's
    ``pattern_min`` (the shortest match it drafts from); the chunk ends early once at most
    ``min_live`` rows still run."""

    base: chunk.ChunkInputs
    history: np.ndarray
    context: np.ndarray
    tokens: int
    q_len: int
    pattern_min: int
    min_live: int = 0

    def pass_shape(self) -> PassShape:
        """The ``shapes.PassShape`` of kind ``"spec_chunk"`` this call runs."""
        rows, width = self.base.pages.shape
        return PassShape("spec_chunk", self.tokens, rows, self.q_len, width)


def _pack(pending, pos, lens, drafts, is_row, live, pages, streams, *, total: int, page_size: int):
    """Packed ``tokens / positions / streams i32[T]``, the ``RaggedMeta`` of one pass, ``cu``
    and the draft lengths fed: live row ``s`` feeds ``[pending, drafts[s, :lens'[s]]]`` at
    ``pos[s]...`` with ``lens'`` = ``lens`` cut to fit ``T`` (``fit_to_budget``); a done row
    feeds one token writing scratch page 0 (counted in the fit: uncounted, the rows after a done
    one lost their last draft tokens past ``T`` while their K/V were taken as written); padding
    rows feed none."""
    n_rows = jnp.sum(is_row.astype(jnp.int32))  # rows that feed a token this pass, done ones included
    lens = fit_to_budget(lens, live & is_row, total, fed=n_rows)
    rows, width = pages.shape
    q = jnp.where(is_row, 1 + lens, 0).astype(jnp.int32)
    cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q).astype(jnp.int32)])
    t = jnp.arange(total, dtype=jnp.int32)
    owner = jnp.clip(jnp.sum((cu[None, 1:] <= t[:, None]).astype(jnp.int32), axis=1), 0, rows - 1)
    used = t < cu[-1]
    j = t - cu[owner]
    fed = jnp.concatenate([pending[:, None], drafts], axis=1)
    tok = jnp.where(used, jnp.take_along_axis(fed[owner], jnp.clip(j, 0, fed.shape[1] - 1)[:, None], axis=1)[:, 0], 0)
    position = jnp.where(used, pos[owner] + j, 0)
    col = jnp.clip(position // page_size, 0, width - 1)
    page = jnp.take_along_axis(pages[owner], col[:, None], axis=1)[:, 0]
    writes = used & live[owner]
    meta = RaggedMeta(kv_lens=jnp.where(is_row, pos + jnp.where(live, q, 0), 0), page_indices=pages, cu_q_lens=cu,
                      num_seqs=jnp.reshape(n_rows, (1,)),
                      slot_mapping=jnp.where(writes, page * page_size + position % page_size, 0))
    return tok.astype(jnp.int32), position.astype(jnp.int32), jnp.where(used, streams[owner], 0), meta, cu, lens


@functools.partial(jax.jit, static_argnums=(0,),
                   static_argnames=("max_passes", "total", "q_len", "page_size", "mode", "attention_impl", "mesh"),
                   donate_argnums=(2,))
def spec_chunk(static: StaticModel, leaves, kv, pending: Int[Array, "S"], positions: Int[Array, "S"],
               pages: Int[Array, "S W"], streams: Int[Array, "S"], budgets: Int[Array, "S"], eos: Int[Array, "E"],
               num_live: Int[Array, ""], passes: Int[Array, ""], min_live: Int[Array, ""], history: Int[Array, "S H"],
               context: Int[Array, "S C"], pattern_min: Int[Array, ""], key,
               temperature: Float[Array, ""], top_k: Int[Array, ""], top_p: Float[Array, ""], *, max_passes: int,
               total: int, q_len: int, page_size: int, mode: str, attention_impl: str, mesh=None):
    """Up to ``passes`` verify passes of ``S`` rows with drafts made on the device (module docstring).

    A row is done after emitting an ``eos`` token or ``budgets`` tokens; the loop ends after
    ``passes`` passes or when at most ``min_live`` rows are still running (the host then runs the
    rest in a smaller row bucket; 0: when every row is done).

    Returns:
      ``(tokens i32[S, N * Q], behaviour logprobs f32[S, N * Q], emitted i32[S], counts i32[4],
      updated kv)``: row ``s`` emitted ``tokens[s, :emitted[s]]``; ``counts``: passes run, row
      passes (live rows summed over passes), drafted and accepted draft tokens.
    """
    rows = pending.shape[0]
    out_w = max_passes * q_len
    is_row = jnp.arange(rows, dtype=jnp.int32) < num_live
    streams = jnp.where(is_row, streams, 0)
    pages = jnp.where(is_row[:, None], pages, 0)
    cols = jnp.arange(q_len, dtype=jnp.int32)[None, :]
    row_ix = jnp.arange(rows, dtype=jnp.int32)[:, None]

    def cond(c):
        return (c[0] < passes) & (jnp.sum(~c[4]) > min_live)

    def body(c):
        i, kv, tok, pos, done, count, ctx, out_t, out_l, tally = c
        live = ~done
        source = jnp.concatenate([history, ctx], axis=1)
        room = jnp.maximum(budgets - count - 1, 0)
        drafts, lens = lookup_drafts(source, pattern_min, jnp.minimum(room, q_len - 1), q_len - 1,
                                     own_from=history.shape[1])
        ptok, ppos, pstream, meta, cu, lens = _pack(jnp.where(is_row, tok, 0), jnp.where(is_row, pos, 0), lens, drafts,
                                                    is_row, live, pages, streams, total=total, page_size=page_size)
        t, lp, n, kv = verify_pass(static, leaves, kv, ptok, ppos, meta, pstream, key, temperature, top_k, top_p,
                                   max_q_len=q_len, mode=mode, attention_impl=attention_impl, mesh=mesh)
        at = jnp.clip(cu[:-1, None] + cols, 0, total - 1)
        emitted, emitted_lp = t[at], lp[at]
        n = jnp.where(live, n[:rows], 0)
        hit = jnp.any(emitted[:, :, None] == eos[None, None, :], axis=2) & (cols < n[:, None])
        first = jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1) + 1, n)
        e = jnp.minimum(jnp.minimum(n, first), budgets - count).astype(jnp.int32)
        dest = jnp.where(cols < e[:, None], count[:, None] + cols, out_w)
        out_t = out_t.at[row_ix, dest].set(emitted, mode="drop")
        out_l = out_l.at[row_ix, dest].set(emitted_lp, mode="drop")
        last = jnp.take_along_axis(emitted, jnp.maximum(e - 1, 0)[:, None], axis=1)[:, 0]
        count = count + e
        stop = jnp.any(hit, axis=1) | (count >= budgets)
        return (i + 1, kv, jnp.where(e > 0, last, tok), pos + e, done | (live & stop), count,
                append_tokens(ctx, emitted, e), out_t, out_l,
                tally + jnp.stack([jnp.int32(1), jnp.sum(live & is_row), jnp.sum(lens),
                                   jnp.sum(jnp.maximum(n - 1, 0))]).astype(jnp.int32))

    init = (jnp.int32(0), kv, pending, positions, ~is_row, jnp.zeros(rows, jnp.int32), context,
            jnp.zeros((rows, out_w), jnp.int32), jnp.zeros((rows, out_w), jnp.float32), jnp.zeros(4, jnp.int32))
    _, kv, _, _, _, count, _, out_t, out_l, tally = jax.lax.while_loop(cond, body, init)
    return out_t, out_l, count, tally, kv


def call(engine, flat_state, inp: SpecChunkInputs, key, scalars, mode):
    """``(jitted function, positional args, keyword args)`` of ``inp`` (``RolloutEngine._call``)."""
    leaves, static = flat_state
    b = inp.base
    kw = dict(max_passes=b.max_passes, total=inp.tokens, q_len=inp.q_len, page_size=engine.page_size, mode=mode,
              attention_impl=engine.attention_impl, mesh=engine.mesh)
    return spec_chunk, (static, leaves, engine.kv, b.pending, b.positions, b.pages, b.streams, b.budgets, b.eos,
                        np.int32(b.num_live), np.int32(b.passes), np.int32(inp.min_live), inp.history, inp.context,
                        np.int32(inp.pattern_min), key, *scalars), kw


def dummy_inputs(shape: PassShape, engine) -> SpecChunkInputs:
    """Inputs of a ``"spec_chunk"`` program with no live row (warm-up: compiles it, runs no pass)."""
    base = chunk.dummy_inputs(PassShape("chunk", shape.rows, shape.rows, 1, shape.width), engine)
    return SpecChunkInputs(base, np.full((shape.rows, engine.draft_history), -1, np.int32),
                           np.full((shape.rows, CONTEXT), -1, np.int32), shape.tokens, shape.q_len, 1)


def _joined(rows: np.ndarray) -> np.ndarray:
    """The tokens of ``rows`` (``int32[m, W]``, ``-1`` = none) one row after another, each
    followed by ``-1``."""
    marked = np.concatenate([rows, np.full((rows.shape[0], 1), -2, np.int32)], axis=1).ravel()
    kept = marked[marked != -1]
    return np.where(kept == -2, -1, kept).astype(np.int32)


def history(engine, table, ids: np.ndarray, drafter, rows: int) -> np.ndarray:
    """``int32[rows, H]`` history of live slots ``ids``: when the drafter drafts from siblings,
    the current tails of the rows of its group (at most half of ``H``; a row's own tail among
    them is harmless: an occurrence followed by ``-1`` is never drafted from), then the prompt's
    previous rollouts (``drafter.history_rows``), whose whole responses come last so that equal
    matches draft from them (the tails end where the chunk starts)."""
    width, n = engine.draft_history, ids.size
    reqs = table.req[ids]
    out = np.full((rows, width), -1, np.int32)
    out[:n] = drafter.history_rows(reqs, width)
    groups = getattr(drafter, "groups", None)
    if groups is None or not getattr(drafter, "siblings", False) or table.tails is None:
        return out
    tails, g = table.tails.get(ids), groups[reqs]
    for group in np.unique(g):
        members = np.flatnonzero(g == group)
        if members.size < 2:
            continue
        piece = _joined(tails[members])[-(width // 2):]
        prev = out[members[0]].copy()
        prev = prev[int(np.argmax(prev >= 0)) if (prev >= 0).any() else width:][piece.size - width:]
        out[members] = -1
        out[members, width - piece.size - prev.size:] = np.concatenate([piece, prev])
    return out


def _common_prefix(drafts: np.ndarray, toks: np.ndarray, lens: np.ndarray, count: np.ndarray) -> np.ndarray:
    """``int64[n]``: how many of row ``i``'s first ``lens[i]`` draft tokens equal its first
    emitted tokens ``toks[i, :count[i]]`` (what a verify pass of that draft would have accepted)."""
    k = min(drafts.shape[1], toks.shape[1])
    cols = np.arange(k)[None, :]
    same = (drafts[:, :k] == toks[:, :k]) & (cols < lens[:, None]) & (cols < count[:, None])
    return np.cumprod(same, axis=1).sum(axis=1).astype(np.int64)


def program(plan, rows: int, want: int, q_want: int = 0) -> tuple[int, int]:
    """``(T, Q)`` of a chunk of ``rows`` rows: the smallest verify pair of the row bucket
    (``shapes.verify_pairs``, ``Q > 1``) with ``T >= want`` packed tokens and ``Q >= q_want``,
    else its largest."""
    pairs = ladder(plan, rows)
    return next(((t, q) for t, q in pairs if t >= want and q >= q_want), pairs[-1])


def ladder(plan, rows: int) -> list[tuple[int, int]]:
    """The verify pairs ``(T, Q)`` with ``Q > 1`` of the ``rows`` row bucket, ascending."""
    return [(t, q) for t, q in verify_pairs(rows, plan.verify_budget) if q > 1]


def guarded_program(engine, rows: int, width: int, want: int, q_want: int,
                    live: int | None = None) -> tuple[int, int] | None:
    """The verify program a chunk of ``live`` rows (default ``rows``) runs: of the ladder's rungs
    up to ``program``'s pair, and the rung above it where the drafts promise it, the one the
    engine's ``SpecGuard.choose`` picks at this row bucket and width (it climbs from the bottom,
    trying a rung once the rungs below it paid or promised it, and runs the one that emitted the
    most tokens a second); ``None`` for a plain chunk. A rung's draft room per live row is
    ``min(Q - 1, (T - live) // live)``."""
    live = rows if live is None else live
    top = program(engine.plan, rows, want, q_want)
    pairs = ladder(engine.plan, rows)
    pairs = pairs[: pairs.index(top) + 2]  # up to the chunk's ask, and the rung above it
    rungs = [(t, engine.pass_cost(rows, t, q, width=width), min(q - 1, (t - live) // max(live, 1)))
             for t, q in pairs]
    above = rungs.pop() if pairs[-1] != top else None
    tokens = engine.spec_guard.choose(rows, width, rungs, engine.pass_cost(rows, rows, 1, width=width), above)
    return None if tokens is None else next(p for p in pairs if p[0] == tokens)


def own_context(table, ids: np.ndarray, rows: int) -> np.ndarray:
    """``int32[rows, CONTEXT]``: the last ``CONTEXT`` tokens of live slots ``ids`` (their tails,
    ending with the pending token), right-aligned, ``-1`` before them and in padding rows."""
    ctx = np.full((rows, CONTEXT), -1, np.int32)
    tails = table.tails.get(ids)
    w = min(CONTEXT, tails.shape[1])
    ctx[:ids.size, CONTEXT - w:] = tails[:, tails.shape[1] - w:]
    return ctx


@functools.partial(jax.jit, static_argnums=(2, 3))
def _shadow_drafts(source: Int[Array, "S L"], pattern_min: Int[Array, ""], k: int, own_from: int):
    """``lookup_drafts`` of every row with a room of ``k`` tokens (a plain chunk's passes)."""
    return lookup_drafts(source, pattern_min, jnp.full((source.shape[0],), k, jnp.int32), k, own_from=own_from)


def graded_plain(engine, table, run, drafter, rows: int, width: int) -> bool:
    """A plain chunk (``chunk.decode_tokens``) that also grades the drafts the device would have
    made at its start (``_shadow_drafts`` over the chunk's ``history`` and the rows' own tokens,
    room ``plan.passes``): a draft token is accepted exactly when plain sampling draws it, so the
    emitted tokens say how many each row would have accepted. The accepted tokens and the drafts
    cut by a miss go to ``SpecGuard.observe_shadow`` under ``(rows, width)``, which lets a rung
    whose drafts now pay be tried before the probe's back-off would (``spec_guard`` docstring).
    Returns ``chunk.decode``'s answer."""
    ids = table.live()
    hist = history(engine, table, ids, drafter, rows)
    source = np.concatenate([hist, own_context(table, ids, rows)], axis=1)
    drafts, lens = _shadow_drafts(source, np.int32(drafter.pattern_min), engine.plan.passes, hist.shape[1])
    out = chunk.decode_tokens(engine, table, run)
    if out is None:
        return False
    toks, count = out
    n = ids.size
    lens = np.asarray(lens[:n], np.int64)
    acc = _common_prefix(np.asarray(drafts[:n]), toks, lens, count)
    engine.spec_guard.observe_shadow(rows, width, int(acc.sum()), int(np.sum(acc < np.minimum(lens, count))))
    return True


def warm_shadow(engine) -> int:
    """Compile ``_shadow_drafts`` for every row bucket of ``engine.plan`` (a chunked HistoSpec
    engine's warm-up); returns the number of shapes."""
    width = engine.draft_history + CONTEXT
    for rows in engine.plan.buckets():
        jax.block_until_ready(_shadow_drafts(np.full((rows, width), -1, np.int32), np.int32(1), engine.plan.passes,
                                             engine.draft_history))
    return len(engine.plan.buckets())


def decode(engine, table, run, drafter) -> bool:
    """One chunk of verify passes with device drafts over the live slots of ``table``: the
    program fits the live rows plus the larger of the draft tokens the host's goodput choice
    sends now and 1.5 x the draft tokens the last chunk accepted per pass, with a draft room
    ``Q - 1`` of at least 1.5 x what the last chunk's best row accepted per pass (``program``;
    the device's drafts carry no estimates, so the last chunk's outcome sizes the next: a row
    that accepts whole drafts, such as a response repeating one token to the cap, climbs the
    ladder ``Q`` = 3, 17, 33 of a small row bucket); the engine's ``SpecGuard``
    (``rollout/spec_guard.py``) picks the rung at or below it that emitted the most tokens a
    second at this width (``guarded_program``); a trial of the guard's (a key's first try or a
    probe) runs at most ``TRIAL_PASSES`` passes. Pages are reserved, the chunk runs and every row's emitted
    tokens are recorded. Falls back to a plain chunk (``chunk.decode``) when the guard finds that
    no rung emitted more tokens a second than decode (with the guard off: when the host
    drafter's choice carries no draft). The host's choice only sizes the chunk: on the ledger
    task's 4,096-token tails it sent no draft in most chunks where the device's drafts from the
    rows' own repeated tokens would have paid. Returns False, having done nothing, when the pool
    cannot hold the chunk."""
    ids = table.live()
    host_drafts, choice = engine._draft(drafter, table, ids)
    if choice.q_len <= 1 and not engine.spec_guard.enabled:  # without the guard the host's choice decides
        return chunk.decode(engine, table, run)
    n, rows = ids.size, engine.plan.bucket(ids.size)
    last, best = table.chunk_accepted_per_pass, table.chunk_best_accepted
    want = n + max(int(choice.draft_lens.sum()), int(np.ceil(1.5 * last)))
    width = engine.table_width(ids)
    pair = guarded_program(engine, rows, width, want, 1 + int(np.ceil(1.5 * best)), n)
    if pair is None:
        table.stats["spec_chunks_declined"] += 1  # no verify program here emits more tokens a second
        return graded_plain(engine, table, run, drafter, rows, width)
    total, q_len = pair
    passes = min(engine.plan.passes, TRIAL_PASSES) if engine.spec_guard.trial else engine.plan.passes
    budgets = chunk.reserve(table, ids, passes * q_len)
    if budgets is None:
        return False
    base = dataclasses.replace(chunk.inputs(engine, table, ids, budgets), passes=passes)
    smaller = [b for b in engine.plan.buckets() if b < rows]
    inp = SpecChunkInputs(base, history(engine, table, ids, drafter, rows), own_context(table, ids, rows), total,
                          q_len, int(drafter.pattern_min), max(smaller, default=0))
    t0 = time.perf_counter()
    toks, lps, count, tally = run(inp)
    count = np.asarray(count[:n], np.int64)
    n_run, row_passes, n_draft, n_acc = (int(x) for x in tally)
    s = table.stats
    s["spec_chunk_seconds"] += time.perf_counter() - t0
    s["spec_chunk_passes"] += n_run
    s["spec_chunk_row_passes"] += row_passes
    s["decode_steps"] += n_run
    s["decode_dispatches"] += 1
    s["sequence_steps"] += row_passes
    s["drafted_tokens"] += n_draft
    s["accepted_tokens"] += n_acc
    table.chunk_accepted_per_pass = n_acc / max(n_run, 1)
    table.chunk_best_accepted = max(float(count.max(initial=0)) / max(n_run, 1) - 1.0, 0.0)
    engine.spec_guard.observe(rows, inp.pass_shape().width, total, n_acc, row_passes, n_draft)  # the key its seconds go under
    toks, lps = np.asarray(toks)[:n], np.asarray(lps)[:n]
    sent = np.asarray(choice.draft_lens, np.int64)
    drafter.observe_chunk(table.req[ids], sent, _common_prefix(host_drafts, toks, sent, count), count)
    step = table.tails.width
    for lo in range(0, int(count.max(initial=0)), step):  # the tails take at most their width at once
        part = np.clip(count - lo, 0, step)
        sel = np.flatnonzero(part > 0)
        table.length[ids[sel]] += table.record(ids[sel], toks[sel, lo:lo + step], lps[sel, lo:lo + step], part[sel])
    return True


__all__ = ["CONTEXT", "SpecChunkInputs", "call", "decode", "dummy_inputs", "graded_plain", "guarded_program", "history",
           "ladder", "own_context", "warm_shadow",
           "program", "spec_chunk"]
