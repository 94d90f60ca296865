"""Guard (issue 50): no decode or verify program hands the attention kernel a slice or copy of the
KV pool. The rollout step is lowered for CUDA on this CPU host (the Pallas Triton kernel lowers to
a ``__gpu$xla.gpu.triton`` custom call without a GPU; ``api.target_backend("gpu")`` picks it), and
the kernel's pool operands are followed back through the StableHLO (``tests/kernel_operands.py``):
each must be the donated pool argument, through the layer loop's carry, reshapes and the K/V
write's in-place scatter only. A ``pool[layer]`` operand would show as a ``dynamic_slice``, which XLA
materialises for a custom call (the suspected ~0.38 ms a layer of SmolLM2's verify passes on an
H200). What the guard cannot see: copies XLA's own passes add after lowering (GPU compile only);
``benchmarks/device_check.sh`` phase ``passcost_buckets`` reports each program's temporaries there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernel_operands import kernel_operand_sources
from pallas_kernels.compat import pl_triton
from pallas_kernels.ragged_paged_attention import api, pallas_gpu
from rhyme_jax.model.config import ModelConfig
from rhyme_jax.model.transformer import Decoder
from rhyme_jax.rollout.engine import EngineConfig, RolloutEngine
from rhyme_jax.rollout.types import SamplingParams

pytestmark = pytest.mark.skipif(pl_triton is None, reason="this jax has no Pallas Triton backend")

# head_dim 16: the smallest the Triton kernel takes; 3 layers so the layer index matters
CFG = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16)


def _lowered_programs(dtype, unroll: int, layer_weights: str = "auto"):
    """Decode and the largest verify program of a 2-slot engine, lowered for CUDA with the kernel
    (64 pages: one layer's pool outweighs every other kernel operand); ``auto`` layer weights are
    the stacked ones there (a GPU target)."""
    graphdef, state = nnx.split(Decoder(CFG, dtype=dtype, param_dtype=dtype, scan_unroll=unroll, rngs=nnx.Rngs(0)))
    with api.target_backend("gpu"):
        eng = RolloutEngine(graphdef, CFG, EngineConfig(max_slots=2, page_size=16, num_pages=64, max_prompt_len=16,
                                                        max_new_tokens=8, eos_ids=(), attention_impl="pallas_gpu",
                                                        layer_weights=layer_weights))
        runner = eng.runner(state, SamplingParams(temperature=1.0, max_new_tokens=8))
        progs = [s for s in eng.programs(spec=True) if s.kind != "prefill" and s.rows == 2]
        picked = [min(progs, key=lambda s: s.tokens), max(progs, key=lambda s: s.tokens)]
        assert [s.kind for s in picked] == ["decode", "verify"]
        return eng, [(s, runner.lower(runner.inputs(s), platforms=("cuda",))) for s in picked]


def _donated(lowered, arg: int) -> bool:
    mod = lowered.compiler_ir("stablehlo")
    main = next(op for op in mod.body.operations if op.attributes["sym_name"].value == "main")
    attrs = str(main.attributes["arg_attrs"][arg])
    return "tf.aliasing_output" in attrs or "jax.buffer_donor" in attrs


@pytest.mark.parametrize("dtype,unroll,layer_weights", [(jnp.float32, 1, "auto"), (jnp.bfloat16, 3, "auto"),
                                                         (jnp.float32, 1, "split")])
def test_kernel_reads_the_donated_pool_not_a_slice(dtype, unroll, layer_weights):
    """In the decode and verify programs (layer loop scanned, unrolled, or a Python loop over
    per-layer weights) the attention kernel's K and V operands are the whole stacked pool
    ``[L, KVH, P*ps, hd]``, reached from the donated pool arguments through the loop carry /
    reshape / in-place scatter only; every other kernel operand is far smaller than one layer's
    pool."""
    eng, programs = _lowered_programs(dtype, unroll, layer_weights)
    split = layer_weights == "split"
    L, kvh, pages, ps, hd = eng.kv.k.shape
    layer_elems = kvh * pages * ps * hd
    for shape, lowered in programs:
        ops = [o for o in kernel_operand_sources(lowered.compiler_ir("stablehlo"))
               if o.kernel == "ragged_paged_attention_gpu"]
        assert len(ops) == (6 * CFG.num_layers if split else 6), shape  # one kernel call in the
        # program text (the loop body, or the block function every unrolled layer calls), or one
        # per layer of the Python loop
        for o in ops:
            if np.prod(o.shape) < layer_elems:
                continue
            assert o.shape == (L, kvh, pages * ps, hd), (shape, o)
            assert o.sources and all(s.clean for s in o.sources), (shape, o)
            assert all(set(s.path) <= {"reshape", "scatter", "call", "while carry", "return", "while"}
                       for s in o.sources), (shape, o)
            assert all(_donated(lowered, int(s.root[5:])) for s in o.sources), (shape, o)
        pools = [o for o in ops if np.prod(o.shape) >= layer_elems]
        # scanned: one source through the carry; unrolled: one per layer's call site
        assert len(pools) == 2 * (CFG.num_layers if split else 1), shape
        assert all(len(o.sources) == (1 if unroll == 1 or split else L) for o in pools), (shape, pools)


def test_guard_sees_a_sliced_pool():
    """The guard's negative case: a layer loop that hands the kernel ``pool[layer]`` (the old
    wiring) shows a ``dynamic_slice`` as the source of the kernel's pool operands."""
    L, kvh, pages, ps, hd, s = 3, 2, 4, 16, 16, 2
    kw = dict(sm_scale=0.25, max_q_len=1)

    def f(q, k, v, kv_lens, page_indices, cu, n):
        def body(h, li):
            o = pallas_gpu.ragged_paged_attention(h, k[li], v[li], kv_lens, page_indices, cu, n, **kw)
            return h + o, None
        return jax.lax.scan(body, q, jnp.arange(L))[0]

    shapes = [((s, 4, hd), jnp.float32)] + [((L, kvh, pages, ps, hd), jnp.float32)] * 2 + [
        ((s,), jnp.int32), ((s, 2), jnp.int32), ((s + 1,), jnp.int32), ((1,), jnp.int32)]
    lowered = jax.jit(f).trace(*[jax.ShapeDtypeStruct(*x) for x in shapes]).lower(lowering_platforms=("cuda",))
    pools = [o for o in kernel_operand_sources(lowered.compiler_ir("stablehlo")) if len(o.shape) == 4 and o.shape[-1] == hd
             and o.shape[-2] == pages * ps]
    assert len(pools) == 2
    assert all(src.root == "stablehlo.dynamic_slice" for o in pools for src in o.sources), pools
