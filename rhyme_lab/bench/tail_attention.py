"""The attention of a rollout's decode and verify passes at the long tail's shapes, per
implementation (``python -m benchmarks.tail_attention``).

A step of ``configs/longtail.yaml`` runs its last rows, those that reach thousands of tokens, in
programs of a row bucket (4, 16 or 64 rows) and a page-table width (24, 96 or 384 pages of 16) set
by the longest row: most rows of such a program are dead and most columns are past every row's
length. Each case here is one such program: ``S`` rows of which ``live`` hold ``context`` cached
tokens, ``W`` page columns, ``Q`` query tokens per live row (1 = decode, more = verify of a draft
of ``Q - 1``). A case times the attention of every layer of the model in one jitted ``lax.scan``
over the stacked pool (``[L, KVH, P, ps, hd]``, read at the scan's layer index as the engine
does), median of ``repeats`` rounds that call each implementation once in turn, after compiling
every one. Figures are milliseconds per pass (attention only) and, per implementation, each verify
case's ratio to the decode case of the same program.

``MODELS`` holds two shape sets: ``longtail`` (``configs/longtail.yaml``'s 4-layer model and the
tail programs above) and ``smollm2`` (SmolLM2-135M's 30 layers, 3 KV heads of 64, and the programs
of ``configs/ablations/longtail_smollm2.yaml``: 16 slots, tables of 80 pages, row buckets 1, 4 and
16, with the engine's pool of ``1 + 16 x 80`` pages).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rhyme_lab.bench.kernels import wall_times

IMPLEMENTATIONS = ("reference", "live_pages")


@dataclasses.dataclass(frozen=True)
class TailCase:
    """One pass program: ``rows`` (bucket S), ``width`` (page columns W), ``live`` rows of
    ``context`` cached tokens (new ones included), ``q_len`` query tokens per live row."""

    rows: int
    width: int
    live: int
    context: int
    q_len: int


# configs/longtail.yaml's tail: 1 row alone, 5 rows in the 16-row bucket, 20 rows at 600 tokens in
# the 64-row bucket at width 96; decode and verify of drafts of 4, 8 and 32 tokens
CASES = tuple(TailCase(s, w, n, c, q) for s, w, n, c in ((4, 384, 1, 4200), (16, 384, 5, 4200), (64, 96, 20, 600))
              for q in (1, 5, 9, 33))
# SmolLM2 at 1,024 new tokens: a row alone at the cap, the 4-row bucket full and half live (80 and 64
# pages: the pass_overhead case of 768 new tokens), the 16-row bucket full and at its tail; decode
# and verify of a 4-token draft
SMOLLM2_CASES = tuple(TailCase(s, w, n, c, q) for s, w, n, c in (
    (1, 80, 1, 1100), (4, 64, 4, 900), (4, 80, 4, 900), (4, 80, 2, 1100), (16, 80, 16, 600), (16, 80, 6, 900),
    (16, 20, 16, 300)) for q in (1, 5))
# model shapes (layers, kv_heads, heads, head_dim, page_size), the pool's pages (0: the cases' own
# 1 + rows x width) and the cases of each shape set
MODELS = {
    "longtail": (dict(layers=4, kv_heads=2, heads=4, head_dim=32, page_size=16), 0, CASES),
    "smollm2": (dict(layers=30, kv_heads=3, heads=9, head_dim=64, page_size=16), 1 + 16 * 80, SMOLLM2_CASES),
}


def case_inputs(rng: np.random.Generator, case: TailCase, *, layers: int, kv_heads: int, heads: int,
                head_dim: int, page_size: int, pool_pages: int = 0):
    """``(q f32[T, H, hd], pool f32[L, KVH, P, ps, hd], kv_lens, page_indices, cu_q_lens, num_seqs)``:
    distinct shuffled pages per row (page 0 the scratch page), dead rows with length 0 and no
    query tokens, ``T = max(S, live x Q)``; ``P = max(pool_pages, 1 + S x W)`` (an engine's pool
    holds every slot's pages, more than one program's table).

    Raises:
      ValueError: ``context`` exceeds the page table (``width x page_size``) or ``q_len`` exceeds it.
    """
    import jax.numpy as jnp

    if case.context > case.width * page_size or case.q_len > case.context:
        raise ValueError(f"{case}: context must lie in [q_len, width x page_size = {case.width * page_size}]")
    num_pages = max(int(pool_pages), 1 + case.rows * case.width)
    table = rng.permutation(np.arange(1, num_pages))[: case.rows * case.width].reshape(case.rows, case.width)
    table = table.astype(np.int32)
    kv = np.zeros(case.rows, np.int32)
    kv[: case.live] = case.context
    cu = np.zeros(case.rows + 1, np.int32)
    cu[1: case.live + 1] = np.arange(1, case.live + 1) * case.q_len
    cu[case.live + 1:] = cu[case.live]
    t = max(case.rows, case.live * case.q_len)
    q = jnp.asarray(rng.standard_normal((t, heads, head_dim)), jnp.float32)
    pool = jnp.asarray(rng.standard_normal((layers, kv_heads, num_pages, page_size, head_dim)), jnp.float32)
    return q, pool, jnp.asarray(kv), jnp.asarray(table), jnp.asarray(cu), jnp.asarray([case.live], np.int32)


def pass_program(case: TailCase, implementation: str, *, layers: int = 4, kv_heads: int = 2, heads: int = 4,
                 head_dim: int = 32, page_size: int = 16, pool_pages: int = 0, seed: int = 0):
    """``(fn, args)``: the jitted attention of ``layers`` layers of one pass ``case`` with
    ``implementation`` (``api.ragged_paged_attention`` in a ``lax.scan`` over the stacked pool),
    compiled and run once, and its inputs; defaults: ``configs/longtail.yaml``'s model, a pool of
    the case's own pages."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.ragged_paged_attention import api

    q, pool, *meta = case_inputs(np.random.default_rng(seed), case, layers=layers, kv_heads=kv_heads,
                                 heads=heads, head_dim=head_dim, page_size=page_size, pool_pages=pool_pages)

    @jax.jit
    def attend(q, pool, *meta):
        def layer(acc, li):
            o = api.ragged_paged_attention(q, pool, pool, *meta, sm_scale=head_dim ** -0.5, max_q_len=case.q_len,
                                           implementation=implementation, layer=li)
            return acc + o, None
        return jax.lax.scan(layer, jnp.zeros_like(q), jnp.arange(layers))[0]

    args = (q, pool, *meta)
    attend(*args).block_until_ready()
    return attend, args


def pass_ms(case: TailCase, implementations=IMPLEMENTATIONS, *, repeats: int = 10, **kw) -> dict[str, float]:
    """Median milliseconds per implementation of one pass ``case`` (``pass_program``; keywords go
    there): every program compiled first, then ``repeats`` rounds that call each implementation
    once in turn, so drift of the machine's speed falls on all of them alike."""
    progs = {i: pass_program(case, i, **kw) for i in implementations}
    times: dict[str, list[float]] = {i: [] for i in implementations}
    for _ in range(repeats):
        for i, (fn, args) in progs.items():
            times[i] += wall_times(fn, args, 1)
    return {i: 1e3 * float(np.median(t)) for i, t in times.items()}


def sweep(cases=CASES, implementations=IMPLEMENTATIONS, log=print, **kw) -> list[dict]:
    """``pass_ms`` of every case, with ``x_decode``: the case's time over the decode case
    (``q_len`` 1) of the same program and implementation (None where that case is not in
    ``cases``). One dict per case: ``rows, width, live, context, q_len, ms: {impl: ms},
    x_decode: {impl: ratio}``."""
    out = []
    for case in cases:
        row = {**dataclasses.asdict(case), "ms": pass_ms(case, implementations, **kw)}
        out.append(row)
        if log:
            log(f"S {case.rows} W {case.width} live {case.live} ctx {case.context} Q {case.q_len}: "
                + ", ".join(f"{i} {ms:.2f} ms" for i, ms in row["ms"].items()))
    for row in out:
        base = next((r for r in out if r["q_len"] == 1 and (r["rows"], r["width"], r["live"], r["context"])
                     == (row["rows"], row["width"], row["live"], row["context"])), None)
        row["x_decode"] = {i: (row["ms"][i] / base["ms"][i] if base else None) for i in implementations}
    return out


def table(rows: list[dict]) -> str:
    """Markdown table of ``sweep``'s rows."""
    impls = list(rows[0]["ms"]) if rows else []
    head = ("| rows S | width W | live rows | context | Q | " + " | ".join(f"{i} ms" for i in impls) + " | "
            + " | ".join(f"{i} x decode" for i in impls) + " |")
    lines = [head, "|" + "---|" * (5 + 2 * len(impls))]
    for r in rows:
        ratios = [f"{r['x_decode'][i]:.2f}" if r["x_decode"][i] is not None else "" for i in impls]
        lines.append(f"| {r['rows']} | {r['width']} | {r['live']} | {r['context']} | {r['q_len']} | "
                     + " | ".join(f"{r['ms'][i]:.2f}" for i in impls) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines) + "\n"
