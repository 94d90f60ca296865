"""Ragged paged attention kernel sweep (``python -m benchmarks.kernels``; its module docstring
describes the method): inputs (``Shape``, ``make_pool``, ``make_metadata``), the implementations
(``parse_variant``, ``build_call``, ``resolve_impls``), the correctness guard and the timing
(``measure``, ``run_shape``, ``run_sweep``), and the HBM roofline (``default_hbm_tbps``,
``copy_bandwidth_tbps``). Reporting is ``rhyme_lab.bench.kernel_report``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention import api, reference
from pallas_kernels.ragged_paged_attention.pallas_gpu import GPUBlockSizes
from pallas_kernels.ragged_paged_attention.pallas_tpu import TPUBlockSizes
from rhyme_lab.bench.kernel_report import KEY_BATCH, KEY_CONTEXT

# Datasheet HBM bandwidth (TB/s) by device_kind substring, first match wins (leads, not readings;
# --hbm-tbps overrides). GH200 before H200: the substring matches both.
HBM_TBPS = (("GH200", 4.0), ("H200", 4.8), ("H100 PCIe", 2.0), ("H100", 3.35), ("H800", 3.35),
            ("A100", 2.0), ("B200", 8.0), ("TPU v6", 1.64), ("TPU v5 lite", 0.819), ("TPU v5e", 0.819),
            ("TPU v5", 2.765), ("TPU v4", 1.2))
DEFAULT_IMPLS = {"gpu": ("pallas_gpu", "reference", "jax_paged_attention"),
                 "tpu": ("pallas_tpu", "reference"), "cpu": ("reference",)}
JAX_PAGED = ("jax_paged_attention", "jax_paged_attention_interpret")
TOL = {"bfloat16": 2e-2, "float32": 2e-5}  # atol = rtol, as pallas_kernels.ragged_paged_attention.cases.TOLERANCE


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmark point (``context`` = kv_len of every sequence, new tokens included)."""

    batch: int
    context: int
    page_size: int
    q_len: int

    @property
    def pages_per_seq(self) -> int:
        """Pages one sequence of ``context`` tokens needs."""
        return -(-self.context // self.page_size)

    def label(self) -> str:
        """``"B<batch> ctx<context> ps<page_size> q<q_len>"``."""
        return f"B{self.batch} ctx{self.context} ps{self.page_size} q{self.q_len}"


# ----------------------------------------------------------------------------- inputs
def make_pool(key, num_kv_heads: int, num_pages: int, page_size: int, head_dim: int, dtype):
    """Random normal ``(k_pages, v_pages) [KVH, num_pages, page_size, hd]`` made on the device."""
    kk, kv = jax.random.split(key)
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    return jax.random.normal(kk, shape, dtype), jax.random.normal(kv, shape, dtype)


def make_metadata(rng: np.random.Generator, shape: Shape, len_spread: float) -> dict[str, np.ndarray]:
    """Ragged metadata of ``shape``: kv_lens (``context``, or uniform in
    ``[context * (1 - len_spread), context]``), shuffled distinct pages (never page 0), cu_q_lens."""
    b, pps = shape.batch, shape.pages_per_seq
    lo = max(shape.q_len, math.ceil(shape.context * (1.0 - len_spread)))
    kv_lens = rng.integers(lo, shape.context + 1, size=b).astype(np.int32)
    pages = (rng.permutation(b * pps) + 1).astype(np.int32).reshape(b, pps)
    cu = np.arange(b + 1, dtype=np.int32) * shape.q_len
    return dict(kv_lens=kv_lens, page_indices=pages, cu_q_lens=cu, num_seqs=np.array([b], np.int32))


def moved_bytes(meta, shape: Shape, num_heads: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Fewest HBM bytes one call must move: K and V of every cached token, q in and out."""
    kv = int(meta["kv_lens"].astype(np.int64).sum()) * num_kv_heads * head_dim * 2
    return (kv + 2 * shape.batch * shape.q_len * num_heads * head_dim) * itemsize


# ----------------------------------------------------------------------------- implementations
def parse_variant(spec: str) -> tuple[str, api.BlockSizes]:
    """``"pallas_gpu:block_q=64,num_warps=8"`` -> (label, ``BlockSizes``); values int or ``none``.

    Raises:
      ValueError: unknown kernel prefix or a bad field (the message names it).
    """
    name, _, fields = spec.partition(":")
    kw = {}
    for item in filter(None, fields.split(",")):
        k, _, v = item.partition("=")
        if not v:
            raise ValueError(f"--variant {spec!r}: field {item!r} is not key=value")
        try:
            kw[k.strip()] = None if v.strip().lower() == "none" else int(v)
        except ValueError:
            raise ValueError(f"--variant {spec!r}: field {k.strip()!r} needs an int or none, got {v!r}") from None
    try:
        if name.startswith("pallas_gpu"):
            bs = api.BlockSizes(gpu=GPUBlockSizes(**kw))
        elif name.startswith("pallas_tpu"):
            bs = api.BlockSizes(tpu=TPUBlockSizes(**kw))
        else:
            raise ValueError(f"--variant {spec!r}: only pallas_gpu*/pallas_tpu* take block sizes")
    except TypeError as exc:
        raise ValueError(f"--variant {spec!r}: {exc}") from None
    return f"{name}[{fields}]", bs


def jax_paged_layout(page_indices: np.ndarray, page_size: int, k_splits: int = 16):
    """Page table for JAX's GPU ``paged_attention``: width padded with the scratch page 0 to a
    multiple of ``k_splits * pages_per_compute_block`` (its divisibility rules); a compute block
    is ~128 tokens. Returns ``(padded table, pages_per_compute_block)``."""
    pps = page_indices.shape[1]
    ppcb = max(1, min(128 // page_size, -(-pps // k_splits)))
    width = -(-pps // (k_splits * ppcb)) * k_splits * ppcb
    return np.pad(page_indices, ((0, 0), (0, width - pps))), ppcb


def build_call(impl: str, block_sizes, shape: Shape, meta, q, k_pages, v_pages, sm_scale: float):
    """``(fn, args)`` with ``fn(*args) -> [T, H, hd]`` packed output; layout adaptation done here."""
    if impl in JAX_PAGED:
        if shape.q_len != 1:
            raise ValueError("jax_paged_attention is a decode kernel (q_len 1)")
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa  # benchmark-only import, not a project kernel

        table, ppcb = jax_paged_layout(meta["page_indices"], shape.page_size)
        fn = functools.partial(jax_pa.paged_attention, pages_per_compute_block=ppcb,
                               interpret=impl.endswith("_interpret"))
        # It applies no score scale: fold sm_scale into q (outside the timed region).
        qs = (q.astype(jnp.float32) * sm_scale).astype(q.dtype)
        return fn, (qs, k_pages, v_pages, jnp.asarray(table), jnp.asarray(meta["kv_lens"]))
    base = impl.split("[")[0]
    fn = functools.partial(api.ragged_paged_attention, sm_scale=sm_scale, max_q_len=shape.q_len,
                           implementation=base, block_sizes=block_sizes)
    return fn, (q, k_pages, v_pages, *(jnp.asarray(meta[k]) for k in
                                        ("kv_lens", "page_indices", "cu_q_lens", "num_seqs")))


def guard_reference(shape: Shape, meta, q, k_pages, v_pages, sm_scale: float, n: int):
    """Reference output of the first ``n`` sequences alone, without TF32: ``[n * q_len, H, hd]`` f32."""
    rows = n * shape.q_len
    fn = jax.jit(functools.partial(reference.ragged_paged_attention, sm_scale=sm_scale, max_q_len=shape.q_len))
    with jax.default_matmul_precision("highest"):
        out = fn(q[:rows], k_pages, v_pages, jnp.asarray(meta["kv_lens"][:n]),
                 jnp.asarray(meta["page_indices"][:n]), jnp.asarray(meta["cu_q_lens"][: n + 1]),
                 jnp.array([n], jnp.int32))
    return np.asarray(out, np.float32)


def compare(out, ref, tol: float) -> tuple[float, bool]:
    """``(max abs error, within atol = rtol = tol and NaN-free)`` of ``out`` against ``ref``."""
    out = np.asarray(out, np.float32)
    err = np.abs(out - ref)
    ok = bool(np.isfinite(out).all() and (err <= tol + tol * np.abs(ref)).all())
    return float(np.nanmax(err)) if err.size else 0.0, ok


def wall_times(fn, args, iters: int) -> list[float]:
    """Seconds of ``iters`` calls ``fn(*args)``, each ended by ``block_until_ready`` (``fn``
    returns one array; compile it, or call it once, before)."""
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t)
    return times


def time_compiled(compiled, args, warmup: int, iters: int) -> dict:
    """Wall-clock a compiled call: ``warmup`` runs, then ``iters`` runs each ended by
    ``block_until_ready`` (median, min, max) and ``iters`` back-to-back runs with one sync at the
    end (``pipelined``: mean, launch gaps hidden). Seconds."""
    for _ in range(warmup):
        compiled(*args).block_until_ready()
    times = wall_times(compiled, args, iters)
    t = time.perf_counter()
    outs = [compiled(*args) for _ in range(iters)]
    outs[-1].block_until_ready()
    pipelined = (time.perf_counter() - t) / iters
    return dict(median_s=statistics.median(times), min_s=min(times), max_s=max(times), pipelined_s=pipelined)


def measure(fn, args, ref, rows_checked: int, tol: float, warmup: int, iters: int) -> dict:
    """Compile ``fn`` ahead of time (``compile_s``), compare its first output's leading
    ``rows_checked`` rows with ``ref`` (``max_abs_err``), and time it only if they agree."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    res = dict(compile_s=time.perf_counter() - t0)
    out = compiled(*args)
    res["max_abs_err"], ok = compare(out[:rows_checked], ref, tol)
    del out
    if not ok:
        return dict(res, status="FAILED(correctness)")
    return dict(res, status="ok", **time_compiled(compiled, args, warmup, iters))


# ----------------------------------------------------------------------------- sweep
def sweep_shapes(args) -> list[Shape]:
    """Every shape of the sweep, the issue's ratio point (batch 64, context 4K) first, then the
    largest, then the rest from small to large (so a budget stop keeps the most telling points)."""
    shapes = [Shape(b, c, p, q) for b in args.batch for c in args.context for p in args.page_size
              for q in args.q_len]
    if not shapes:
        raise ValueError("empty sweep: give at least one --batch, --context, --page-size and --q-len")
    key = lambda s: (s.batch, s.context)  # noqa: E731
    biggest = max(key(s) for s in shapes)
    rank = lambda s: (key(s) != (KEY_BATCH, KEY_CONTEXT), key(s) != biggest, s.batch * s.context,  # noqa: E731
                      s.batch, s.page_size, s.q_len)
    return sorted(shapes, key=rank)


def _error(exc: Exception) -> str:
    return f"ERROR({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]})"


def run_shape(args, shape: Shape, meta, q, k_pages, v_pages, impls, hbm_tbps, deadline: float, emit) -> None:
    """Guard and time every implementation on one shape; ``emit(row)`` after each."""
    dtype = jnp.dtype(args.dtype)
    sm_scale = args.head_dim ** -0.5
    nbytes = moved_bytes(meta, shape, args.heads, args.kv_heads, args.head_dim, dtype.itemsize)
    n_chk = min(args.check_seqs, shape.batch)
    ref = guard_reference(shape, meta, q, k_pages, v_pages, sm_scale, n_chk)
    for impl, bs in impls:
        row = dict(shape=dataclasses.asdict(shape), label=shape.label(), impl=impl, bytes=nbytes)
        if impl.split("[")[0] in JAX_PAGED and shape.q_len != 1:
            row["status"] = "n/a (decode only)"
        elif time.perf_counter() > deadline:
            row["status"] = "SKIPPED(budget)"
        elif impl == "reference" and shape.batch * shape.context > args.ref_max_tokens:
            row["status"] = "SKIPPED(--ref-max-tokens)"
        else:
            try:
                fn, call_args = build_call(impl, bs, shape, meta, q, k_pages, v_pages, sm_scale)
                row.update(measure(fn, call_args, ref, n_chk * shape.q_len, TOL[dtype.name], args.warmup,
                                   args.iters))
                if row["status"] == "ok":
                    row["gbps"] = nbytes / row["median_s"] / 1e9
                    if hbm_tbps:
                        row["pct_roofline"] = 100.0 * row["gbps"] / (hbm_tbps * 1e3)
            except Exception as exc:  # one failing kernel must not end the sweep
                row["status"] = _error(exc)
        emit(row)


def run_sweep(args, impls: list[tuple[str, object]], hbm_tbps: float | None, emit) -> None:
    """Time every (shape, implementation) of the sweep, ``emit(row)`` after each; past
    ``--max-seconds`` the remaining rows are emitted as ``SKIPPED(budget)``."""
    deadline = time.perf_counter() + args.max_seconds if args.max_seconds > 0 else math.inf
    rng = np.random.default_rng(args.seed)
    key = jax.random.key(args.seed)
    groups: dict[tuple, list[Shape]] = {}
    for s in sweep_shapes(args):  # one pool per (batch, context, page size), shared by its q_lens
        groups.setdefault((s.batch, s.context, s.page_size), []).append(s)
    for (b, _, ps), group in groups.items():
        emitted: set[tuple[str, str]] = set()

        def emit_once(row):
            emitted.add((row["label"], row["impl"]))
            emit(row)

        k_pages = v_pages = None
        try:
            for shape in group:
                if time.perf_counter() > deadline:
                    for impl, _ in impls:
                        emit_once(dict(shape=dataclasses.asdict(shape), label=shape.label(), impl=impl,
                                       status="SKIPPED(budget)"))
                    continue
                if k_pages is None:
                    key, kpool = jax.random.split(key)
                    meta = make_metadata(rng, shape, args.len_spread)
                    k_pages, v_pages = make_pool(kpool, args.kv_heads, b * shape.pages_per_seq + 1, ps,
                                                 args.head_dim, jnp.dtype(args.dtype))
                shape_meta = dict(meta, cu_q_lens=np.arange(b + 1, dtype=np.int32) * shape.q_len)
                q = jax.random.normal(jax.random.fold_in(key, shape.q_len),
                                      (b * shape.q_len, args.heads, args.head_dim), jnp.dtype(args.dtype))
                run_shape(args, shape, shape_meta, q, k_pages, v_pages, impls, hbm_tbps, deadline, emit_once)
        except Exception as exc:  # e.g. the pool does not fit: the group's other rows say so, go on
            print(f"B{b} ps{ps}: {_error(exc)}", flush=True)
            for shape in group:
                for impl, _ in impls:
                    if (shape.label(), impl) not in emitted:
                        emit_once(dict(shape=dataclasses.asdict(shape), label=shape.label(), impl=impl,
                                       status=_error(exc)))
        finally:
            for arr in (k_pages, v_pages):
                if arr is not None:
                    arr.delete()


def copy_bandwidth_tbps(nbytes: int = 1 << 31, iters: int = 10) -> float:
    """Measured device copy bandwidth (bytes read + written per second, TB/s) of ``x + 1`` on a
    bf16 array of ``nbytes``: the practical ceiling beside the datasheet one."""
    x = jnp.ones((nbytes // 2,), jnp.bfloat16) * jax.random.normal(jax.random.key(1), (), jnp.bfloat16)
    f = jax.jit(lambda a: a + 1).lower(x).compile()
    f(x).block_until_ready()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t)
    x.delete()
    return 2 * nbytes / statistics.median(ts) / 1e12


def default_hbm_tbps(device_kind: str) -> float | None:
    """Datasheet bandwidth for ``device_kind`` from ``HBM_TBPS``; ``None`` when unknown (CPU)."""
    return next((v for k, v in HBM_TBPS if k.lower() in device_kind.lower()), None)


def resolve_impls(args, backend: str) -> list[tuple[str, object]]:
    """``[(label, BlockSizes | None)]`` to time; unknown or not-runnable names raise ValueError."""
    names = args.impls.split(",") if args.impls else list(DEFAULT_IMPLS.get(backend, ("reference",)))
    runnable = set(api.available_implementations()) | {"jax_paged_attention_interpret"}
    if backend == "gpu":
        runnable.add("jax_paged_attention")
    out = []
    for n in (x.strip() for x in names if x.strip()):
        if n not in runnable:
            raise ValueError(f"--impls: {n!r} cannot run on backend {backend!r}; runnable: {sorted(runnable)}")
        out.append((n, None))
    for spec in args.variant:
        label, bs = parse_variant(spec)
        if label.split("[")[0] not in runnable:
            raise ValueError(f"--variant: {label.split('[')[0]!r} cannot run on backend {backend!r}")
        out.append((label, bs))
    return out
