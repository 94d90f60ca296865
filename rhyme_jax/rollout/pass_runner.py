"""One forward-pass program of a ``RolloutEngine`` run (or lowered) on given inputs: the public way to
time, profile or compile a pass outside a rollout (benchmarks, ``rhyme-jax compile-report``, the
pass-cost profile, warm-up), so no caller outside ``rollout/`` touches the engine's internals; and the
engine's pass-cost model measured or loaded through it (``profile_pass_cost``, ``use_pass_cost``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from rhyme_jax.rollout import batching, chunk, chunk_spec
from rhyme_jax.rollout.pass_cost import PROFILE_VERSION, PassCost, cache_path, profile
from rhyme_jax.rollout.types import SamplingParams


class PassRunner:
    """Runs ``engine``'s pass programs over ``state`` with ``sampling``'s program (mode, T, top-k,
    top-p) and a fixed key.

    Args:
      engine: the ``RolloutEngine``.
      state: the model's ``nnx.State`` (arrays, or ``jax.ShapeDtypeStruct`` leaves to lower only).
      sampling: its temperature / top-k / top-p pick the sampling program.
      key: the step's PRNG key (default ``jax.random.key(0)``).
      allocate: create the engine's KV pool for ``state``'s dtype if missing (False for abstract
        state: the caller sets ``engine.kv = engine.abstract_pool(state)``).

    Raises:
      ValueError: ``sampling``'s temperature / top-k / top-p are out of range.
    """

    def __init__(self, engine, state, sampling: SamplingParams, *, key=None, allocate: bool = True):
        self.engine, self.sampling = engine, sampling
        self.mode = sampling.mode
        self.key = jax.random.key(0) if key is None else key
        if allocate:
            engine._ensure_pool(state)
        self.flat_state = engine._flat_state(state)

    def inputs(self, shape, *, busy: bool = False, own_pages: int = 0) -> batching.PassInputs:
        """Dummy inputs of the pass program ``shape`` (``batching.pass_inputs``; with ``busy``, a
        decode/verify step whose rows are all live, ``batching.busy_verify``; a ``"chunk"`` program:
        ``chunk.dummy_inputs``, no live row)."""
        e = self.engine
        if shape.kind == "chunk":
            return chunk.dummy_inputs(shape, e)
        if shape.kind == "spec_chunk":
            return chunk_spec.dummy_inputs(shape, e)
        if busy:
            return batching.busy_verify(shape, e.max_slots, e.pages_per_seq, e.page_size, own_pages)
        return batching.pass_inputs(shape, e.max_slots, e.pages_per_seq)

    def run(self, inp: batching.PassInputs, *, live: bool = False) -> tuple[Any, ...]:
        """Run one step on ``inp`` and wait for its tokens on the host. Prefill ->
        ``(tokens int32[S], logprobs float32[S])``; decode/verify -> ``(tokens int32[T], logprobs
        float32[T], num_emitted int32[S])``; chunk -> ``(tokens int32[N, S], logprobs float32[N, S],
        emitted int32[S], passes run int32)``. The KV pool is donated and replaced in place."""
        return self.engine._run(self.flat_state, inp, self.key, self.sampling, self.mode, live)

    def lower(self, inp: batching.PassInputs, *, platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
        """The step on ``inp`` lowered for XLA (``.compile()`` it; its ``memory_analysis()`` gives
        the program's temporaries). Nothing runs. ``platforms`` (e.g. ``("cuda",)``): lower for
        those platforms instead of this host's (inspect only; with the engine built inside
        ``pallas_kernels.ragged_paged_attention.api.target_backend`` to pick their kernels)."""
        fn, args, kw = self.engine._call(self.flat_state, inp, self.key, self.sampling, self.mode)
        if platforms is None:
            return fn.lower(*args, **kw)
        return fn.trace(*args, **kw).lower(lowering_platforms=tuple(platforms))


def profile_pass_cost(engine, state, sampling: SamplingParams, repeats: int = 5) -> PassCost:
    """Measure ``engine.pass_cost``: the median of ``repeats`` rounds of runs of every
    decode/verify program (``pass_cost.profile`` over ``engine.programs(spec=True)`` with every
    row live on its own pages when no slot holds any, ``batching.busy_verify``; each compiled or
    loaded first). Sets and returns the new model (its ``meta`` names backend and device)."""
    runner = PassRunner(engine, state, sampling)
    own_pages = engine.num_pages if not engine.allocator.num_held.any() else 0  # pool idle: rows on their own pages
    secs = profile(lambda shape: runner.run(runner.inputs(shape, busy=True, own_pages=own_pages)),
                   engine.programs(spec=True), repeats)
    meta = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "source": "profiled"}
    engine.pass_cost = PassCost(secs, meta)
    return engine.pass_cost


def use_pass_cost(engine, state, sampling: SamplingParams, path: str = "") -> PassCost:
    """Set and return ``engine.pass_cost`` from ``path`` (a ``PassCost`` JSON; ``"prior"``: the
    analytical prior) or, with no path, from the cache file of the engine's model, dtype,
    backend, device kind and plan (``pass_cost.cache_path``), profiling and caching it when there
    is none.

    Raises:
      PassCostError: ``path`` (or a corrupt cache file) cannot be read.
    """
    if path:
        engine.pass_cost = PassCost.prior() if path == "prior" else PassCost.load(path)
        return engine.pass_cost
    leaves = jax.tree.leaves(jax.eval_shape(engine._cast, state))  # shapes and the dtype it runs in
    cfg = engine.model_cfg
    parts = {"profile": PROFILE_VERSION, "model": [cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size,
                                                   sum(int(np.prod(x.shape)) for x in leaves)],
             "dtype": str(leaves[0].dtype) if leaves else "", "backend": jax.default_backend(),
             "device": jax.devices()[0].device_kind, "devices": int(engine.mesh.size),
             "attention": engine.attention_impl, "plan": dataclasses.astuple(engine.plan)}
    cached = cache_path(parts)
    if cached.is_file():
        engine.pass_cost = PassCost.load(cached)
    else:
        profile_pass_cost(engine, state, sampling).save(cached)
    return engine.pass_cost
