"""Dispatch for ragged paged attention: pick an implementation by name.

Which one runs where: docs/architecture.md, "Attention implementations".

Implementations (same signature and semantics as ``reference.ragged_paged_attention``):

=========================  ==================================================================
``reference``              plain ``jax.numpy`` oracle; any backend
``live_pages``             plain ``jax.numpy``, reads only the live rows' pages (``live_pages.py``);
                           any backend; ``auto`` off TPU and GPU
``pallas_tpu``             Mosaic TPU kernel (``pallas_tpu.py``); TPU only
``pallas_gpu``             Pallas GPU kernel, Triton lowering (``pallas_gpu.py``); NVIDIA GPU
``pallas_tpu_interpret``   the TPU kernel on the TPU interpreter (CPU tests; slow)
``pallas_gpu_interpret``   the GPU kernel with ``interpret=True`` (CPU tests; slow)
=========================  ==================================================================

``implementation`` is a name, ``"auto"``, or an ordered list of names (a sequence, or a
comma-separated string as in the config: ``"pallas_gpu,reference"``):

* a single name fails fast (``ValueError``) when it is unknown or cannot run on this backend;
* a list takes the first entry that can run here and warns when it skips one;
* ``"auto"`` is ``["pallas_tpu", "reference"]`` on TPU, ``["pallas_gpu", "reference"]`` on GPU
  and ``"live_pages"`` elsewhere (the CPU). On an accelerator, ``auto`` also compiles the kernel once on
  a small probe batch and falls back to the reference, with a warning, if that fails.

Block sizes live in ``BlockSizes`` (one field per kernel); pass them as ``block_sizes=`` (default:
``default_block_sizes(max_q_len, q.dtype)``, which documents the rule).

A layer loop passes the stacked pool ``[L, KVH, P, ps, hd]`` and ``layer=`` (its index) rather than
``pool[layer]``: the GPU kernel then reads the layer in place (``ragged_paged_attention``).
``target_backend("gpu")`` resolves names for a backend this host lacks, to lower programs for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallas_kernels.ragged_paged_attention import live_pages, pallas_gpu, pallas_tpu, reference


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of each kernel (hashable: a static argument under jit).

    Attributes:
      tpu: ``pallas_tpu.TPUBlockSizes`` (pages per KV block, query tokens per block).
      gpu: ``pallas_gpu.GPUBlockSizes`` (query rows per program, pages per KV block, warps,
        pipeline stages).
    """

    tpu: pallas_tpu.TPUBlockSizes = dataclasses.field(default_factory=pallas_tpu.TPUBlockSizes)
    gpu: pallas_gpu.GPUBlockSizes = dataclasses.field(default_factory=pallas_gpu.GPUBlockSizes)


# Query rows per GPU program (GPUBlockSizes.block_q) by dtype when a step carries more than one
# query token per sequence (verify, prefill); decode (max_q_len 1) keeps the kernel's default 16.
# bf16: measured on one H200 (jax 0.11.2, python -m benchmarks.kernels, 2026-11-30): for q_len 9,
# block_q 64 ran 1.6-2.2x faster than 16 at each of the 7 shapes timed (batch 64-256, context
# 2K-16K, pages 16/64); for decode 16 was faster. f32: 16, not 64: with f32 operands the 64-row
# variant needs 255 registers a thread and spills (16 rows: 80), as the review of issue 50 read
# them from the compiled kernels, and a verify step's 3-9 real query positions x G heads fill few of 64 rows anyway.
GPU_MULTI_QUERY_BLOCK_Q = {"bfloat16": 64, "float16": 64, "float32": 16}
GPU_DECODE_BLOCK_Q = 16


def default_block_sizes(max_q_len: int, dtype) -> BlockSizes:
    """Each kernel's tiling for a step whose longest query has ``max_q_len`` tokens in ``dtype``
    (the queries' and the pool's dtype).

    The rule (GPU; the TPU kernel keeps its own defaults):

    ===================  ===========  ==============================================================
    step                 ``block_q``  why
    ===================  ===========  ==============================================================
    ``max_q_len == 1``   16           decode: one position x ``G`` heads; 16 is the smallest MMA tile
    ``> 1``, bf16/f16    64           measured fastest for verify (q_len 9) on an H200
    ``> 1``, f32         16           64 rows of f32 spill registers (255 a thread, 16 rows: 80);
                                      verify's 3-9 positions x ``G`` heads leave most of 64 rows idle
    ===================  ===========  ==============================================================

    Constants: ``GPU_DECODE_BLOCK_Q``, ``GPU_MULTI_QUERY_BLOCK_Q`` (source and dates beside them).
    f32 prefill (long queries) has not been timed with another tiling; ``benchmarks/device_check.sh``
    phase ``kregs`` reports registers and spills of each candidate.
    """
    if max_q_len <= 1:
        block_q = GPU_DECODE_BLOCK_Q
    else:
        block_q = GPU_MULTI_QUERY_BLOCK_Q.get(jnp.dtype(dtype).name, GPU_DECODE_BLOCK_Q)
    if block_q == pallas_gpu.GPUBlockSizes().block_q:
        return BlockSizes()
    return BlockSizes(gpu=pallas_gpu.GPUBlockSizes(block_q=block_q))


@dataclasses.dataclass(frozen=True)
class _Impl:
    fn: Callable
    backends: tuple[str, ...] | None  # None = any backend
    kernel: str | None = None  # which BlockSizes field it takes
    interpret: bool = False
    stacked: bool = False  # takes the stacked [L, ...] pool and a layer= index itself


_IMPLEMENTATIONS: dict[str, _Impl] = {
    "reference": _Impl(reference.ragged_paged_attention, None),
    "live_pages": _Impl(live_pages.ragged_paged_attention, None, stacked=True),
    "pallas_tpu": _Impl(pallas_tpu.ragged_paged_attention, ("tpu",), "tpu"),
    "pallas_gpu": _Impl(pallas_gpu.ragged_paged_attention, ("gpu",), "gpu", stacked=True),
    "pallas_tpu_interpret": _Impl(pallas_tpu.ragged_paged_attention, None, "tpu", True),
    "pallas_gpu_interpret": _Impl(pallas_gpu.ragged_paged_attention, None, "gpu", True, stacked=True),
}
_AUTO = {"tpu": ("pallas_tpu", "reference"), "gpu": ("pallas_gpu", "reference")}
_AUTO_ELSEWHERE = "live_pages"  # CPU and any other backend: plain jax.numpy, reads only the live pages
_TARGET: list[str] = []  # target_backend's stack


@contextlib.contextmanager
def target_backend(backend: str):
    """Dispatch as if ``backend`` (``"gpu"``, ``"tpu"``, ``"cpu"``) were the default backend, to
    lower programs for it on another host (``jax.jit(f).trace(...).lower(lowering_platforms=
    ("cuda",))`` on CPU): ``"auto"`` picks that backend's kernel without its probe (nothing runs).
    Names resolved inside are cached apart from the real backend's."""
    _TARGET.append(backend)
    try:
        yield
    finally:
        _TARGET.pop()


def _backend() -> str:
    return _TARGET[-1] if _TARGET else jax.default_backend()


def current_backend() -> str:
    """The backend programs are built for: ``target_backend``'s inside it, else
    ``jax.default_backend()`` (``"cpu"``, ``"gpu"``, ``"tpu"``)."""
    return _backend()


def available_implementations() -> tuple[str, ...]:
    """Names that can run on the current default backend (``target_backend``'s inside it;
    registration order)."""
    backend = _backend()
    return tuple(n for n, impl in _IMPLEMENTATIONS.items() if impl.backends is None or backend in impl.backends)


def register_implementation(name: str, fn: Callable, backends: Sequence[str] | None = None) -> None:
    """Register ``fn`` (signature of ``reference.ragged_paged_attention``) under ``name``,
    runnable on ``backends`` (``None`` = any)."""
    _IMPLEMENTATIONS[name] = _Impl(fn, None if backends is None else tuple(backends))
    _resolve.cache_clear()


def _runnable(name: str, backend: str) -> bool:
    impl = _IMPLEMENTATIONS.get(name)
    return impl is not None and (impl.backends is None or backend in impl.backends)


def _probe(name: str) -> Exception | None:
    """Compile and run ``name`` on a tiny decode + verify batch; the exception if it fails."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((8, 8, 128)), jnp.bfloat16)
    pages = jnp.asarray(rng.standard_normal((2, 5, 16, 128)), jnp.bfloat16)
    meta = (jnp.array([5, 20], jnp.int32), jnp.array([[1, 2], [3, 4]], jnp.int32),
            jnp.array([0, 1, 5], jnp.int32), jnp.array([2], jnp.int32))
    try:
        out = ragged_paged_attention(q, pages, pages, *meta, sm_scale=0.1, max_q_len=4,
                                     implementation=name)
        want = reference.ragged_paged_attention(q, pages, pages, *meta, sm_scale=0.1, max_q_len=4)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32))))
        if not err < 5e-2:
            return RuntimeError(f"probe output differs from the reference by {err}")
    except Exception as exc:  # any lowering/compile/runtime failure means: not usable here
        return exc
    return None


def resolve_name(implementation: str | tuple[str, ...]) -> str:
    """The implementation name that ``implementation`` selects on this backend (or the
    ``target_backend``), cached per backend.

    Raises:
      ValueError: a single name that is unknown or cannot run on this backend, or a list with
        no runnable entry.
    """
    return _resolve(implementation, _backend(), bool(_TARGET))


@functools.lru_cache(maxsize=None)
def _resolve(implementation: str | tuple[str, ...], backend: str, lowering_only: bool) -> str:
    if implementation == "auto":
        if backend not in _AUTO:
            return _AUTO_ELSEWHERE
        kernel = _AUTO[backend][0]
        if lowering_only:
            return kernel
        failure = _probe(kernel)
        if failure is not None:
            warnings.warn(f"ragged_paged_attention: {kernel!r} failed its probe on {backend} "
                          f"({type(failure).__name__}: {str(failure)[:200]}); using 'reference'")
            return "reference"
        return kernel
    if isinstance(implementation, str):
        if implementation not in _IMPLEMENTATIONS:
            raise ValueError(f"ragged_paged_attention: unknown implementation {implementation!r}; "
                             f"known: {list(_IMPLEMENTATIONS) + ['auto']}")
        if not _runnable(implementation, backend):
            raise ValueError(
                f"ragged_paged_attention: implementation {implementation!r} needs backend "
                f"{_IMPLEMENTATIONS[implementation].backends}, this one is {backend!r}; "
                f"runnable here: {list(available_implementations())}")
        return implementation
    names = list(implementation)
    for i, name in enumerate(names):
        if _runnable(name, backend):
            if i:
                warnings.warn(f"ragged_paged_attention: {names[:i]} cannot run on "
                              f"{backend!r}, falling back to {name!r}")
            return name
    raise ValueError(f"ragged_paged_attention: none of {names} can run on {backend!r}; "
                     f"runnable here: {list(available_implementations())}")


def parse_implementation(spec: str | Sequence[str]) -> str | tuple[str, ...]:
    """``"a,b"`` (a config string) or a sequence -> an ordered tuple of names; a single name or
    ``"auto"`` stays a string (hashable either way, for ``resolve_name``)."""
    if isinstance(spec, str):
        names = tuple(n.strip() for n in spec.split(",") if n.strip())
        return names[0] if len(names) == 1 else names
    return tuple(spec)


def resolve_implementation(implementation: str | Sequence[str]) -> Callable:
    """The attention function selected by ``implementation`` (see ``resolve_name``).

    Raises:
      ValueError: as ``resolve_name``.
    """
    return _IMPLEMENTATIONS[resolve_name(parse_implementation(implementation))].fn


def ragged_paged_attention(
    q: Float[Array, "T H hd"],
    k_pages: Float[Array, "*L KVH P ps hd"],
    v_pages: Float[Array, "*L KVH P ps hd"],
    kv_lens: Int[Array, "S"],
    page_indices: Int[Array, "S pps"],
    cu_q_lens: Int[Array, "S+1"],
    num_seqs: Int[Array, "1"],
    *,
    sm_scale: float,
    max_q_len: int,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    implementation: str | Sequence[str] = "reference",
    block_sizes: BlockSizes | None = None,
    layer: int | Int[Array, ""] | None = None,
) -> Float[Array, "T H hd"]:
    """Ragged paged attention; see ``reference.ragged_paged_attention`` for the exact semantics.

    Args:
      k_pages, v_pages: one layer's pool ``[KVH, P, ps, hd]``, or with ``layer`` the stacked
        pool ``[L, KVH, P, ps, hd]`` of every layer.
      implementation: name, ``"auto"`` or ordered list (module docstring).
      block_sizes: kernel tiling; ``None`` = ``default_block_sizes(max_q_len, q.dtype)``.
        Ignored by ``reference``.
      layer: the layer of a stacked pool to read (int or int32 scalar, e.g. a ``lax.scan``
        index). The GPU kernel and ``live_pages`` take the whole stacked pool and read the layer
        inside it, so a layer loop never slices or copies the pool; the other implementations
        get ``k_pages[layer]`` (the reference's gathers read through the slice, so it stays the
        oracle it was; the TPU kernel would see a per-layer operand).

    Raises:
      ValueError: ``implementation`` selects nothing runnable here.
    """
    impl = _IMPLEMENTATIONS[resolve_name(parse_implementation(implementation))]
    kw = dict(sm_scale=sm_scale, max_q_len=max_q_len, soft_cap=soft_cap, sliding_window=sliding_window)
    if impl.kernel is not None:
        kw["block_sizes"] = getattr(block_sizes or default_block_sizes(max_q_len, q.dtype), impl.kernel)
        kw["interpret"] = impl.interpret
    if layer is not None:
        if impl.stacked:
            kw["layer"] = layer
        else:
            k_pages, v_pages = k_pages[layer], v_pages[layer]
    return impl.fn(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **kw)


def sharded_ragged_paged_attention(
    mesh: jax.sharding.Mesh,
    q: Float[Array, "T H hd"],
    k_pages: Float[Array, "*L KVH P ps hd"],
    v_pages: Float[Array, "*L KVH P ps hd"],
    kv_lens: Int[Array, "S"],
    page_indices: Int[Array, "S pps"],
    cu_q_lens: Int[Array, "S+1"],
    num_seqs: Int[Array, "1"],
    *,
    head_axis: str = "tensor",
    layer: int | Int[Array, ""] | None = None,
    **kwargs,
) -> Float[Array, "T H hd"]:
    """``ragged_paged_attention`` inside ``shard_map`` over ``mesh``: query heads and the KV pool's
    KV heads are split over mesh axis ``head_axis`` (tensor parallelism over heads, each device
    holding the pages of its KV heads); the ragged metadata is replicated. Every other mesh axis
    sees replicated inputs.

    In specs: ``q P(None, head_axis, None)``, ``k/v_pages P(head_axis)`` (stacked pool with
    ``layer``: ``P(None, head_axis)``), metadata and ``layer`` ``P()``; out spec
    ``P(None, head_axis, None)``. Keyword arguments go to ``ragged_paged_attention``.

    Raises:
      ValueError: the head counts are not divisible by the ``head_axis`` size, or
        ``head_axis`` is not a mesh axis.
    """
    from jax.sharding import PartitionSpec as P

    if head_axis not in mesh.axis_names:
        raise ValueError(f"ragged_paged_attention: mesh axes {mesh.axis_names} lack {head_axis!r}")
    n = mesh.shape[head_axis]
    kvh = k_pages.shape[0 if layer is None else 1]
    if q.shape[1] % n or kvh % n:
        raise ValueError(f"ragged_paged_attention: num_heads={q.shape[1]} and num_kv_heads="
                         f"{kvh} must be divisible by mesh axis {head_axis!r} of size {n}")
    heads, rep = P(None, head_axis, None), P()
    pool = P(head_axis) if layer is None else P(None, head_axis)
    args = (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if layer is not None:
        args += (jnp.asarray(layer, jnp.int32),)

    def body(*a):
        return ragged_paged_attention(*a[:7], layer=a[7] if len(a) > 7 else None, **kwargs)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(heads, pool, pool) + (rep,) * (len(args) - 3),
                       out_specs=heads, check_vma=False)
    return fn(*args)


write_kv = reference.write_kv

__all__ = ["BlockSizes", "default_block_sizes", "parse_implementation", "target_backend", "sharded_ragged_paged_attention", "available_implementations", "ragged_paged_attention", "register_implementation",
           "resolve_implementation", "resolve_name", "write_kv"]
