"""Attention dispatch: name / list / auto resolution, kernels inside the engine, shard_map specs.

Tolerances: two implementations of the same attention (the Pallas kernels in interpret mode, or
the op sharded over heads, against the reference) differ by at most twice one's float32 error
(``f32.between_programs``); for these cases (head_dim <= 16, <= 16 keys, |v| < 4) that is below
1e-5 (see tests/test_attention_reference.py for the bound), hence ``atol=1e-5`` / ``2e-5``
(the kernel's online softmax rescales once per KV block: one more rounding per block). Through
the engine, the logprobs of the same greedy tokens differ by ``f32.logprobs`` of the tiny model
(below 1e-4).
"""

import dataclasses
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import api, pallas_gpu
from pallas_kernels.ragged_paged_attention.cases import TOLERANCE
from flax import nnx

from rhyme_jax.model.config import ModelConfig
from rhyme_jax.model.transformer import Decoder
from rhyme_jax.rollout.engine import EngineConfig, EngineConfigError, RolloutEngine, SamplingParams
from test_rollout_engine import _engine, _prompts

# Kernels need head_dim a power of two >= 16 (Triton tiles); GQA group 2.
KCFG = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)


def test_single_name_fails_fast():
    with pytest.raises(ValueError, match="unknown implementation 'flash'"):
        api.resolve_implementation("flash")
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="needs backend"):
            api.resolve_implementation("pallas_tpu")
        with pytest.raises(EngineConfigError, match="attention_impl"):
            _engine(attention_impl="pallas_gpu")


def test_list_falls_back_with_warning_and_auto_picks_backend():
    if jax.default_backend() != "cpu":
        pytest.skip("CPU dispatch rules")
    with pytest.warns(UserWarning, match="falling back to 'reference'"):
        assert api.resolve_name(("pallas_tpu", "pallas_gpu", "reference")) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert api.resolve_name("auto") == "live_pages"  # the CPU: plain jax.numpy over the live pages
        assert api.resolve_name(("pallas_gpu_interpret", "reference")) == "pallas_gpu_interpret"
    with pytest.raises(ValueError, match="none of"):
        api.resolve_name(("pallas_tpu", "pallas_gpu"))
    assert "pallas_tpu" not in api.available_implementations()


@pytest.mark.parametrize("impl", ["live_pages", "pallas_gpu_interpret", "pallas_tpu_interpret"])
def test_engine_greedy_with_kernel_equals_reference(impl):
    prompts = _prompts(4, (5, 11, 3))
    sp = SamplingParams(temperature=0.0, max_new_tokens=5)
    graphdef, state = nnx.split(Decoder(KCFG, rngs=nnx.Rngs(0)))
    state = jax.tree.map(lambda x: x * 20.0 if x.ndim == 2 else x, state)  # varied greedy tokens

    def engine(impl):
        return RolloutEngine(graphdef, KCFG, EngineConfig(max_slots=3, page_size=4, num_pages=0, max_prompt_len=16,
                                                          max_new_tokens=5, eos_ids=(), attention_impl=impl))

    want = engine("reference").generate(state, prompts, sp, jax.random.key(0))
    got = engine(impl).generate(state, prompts, sp, jax.random.key(0))
    assert len({tuple(t) for t in want.tokens}) > 1
    for a, b, la, lb in zip(got.tokens, want.tokens, got.logprobs, want.logprobs):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(la, lb, atol=1e-4)


_SHARDED = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from pallas_kernels.ragged_paged_attention import api, reference
    from pallas_kernels.ragged_paged_attention.cases import random_case
    assert len(jax.devices()) == 8
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "tensor"))
    case = random_case(np.random.default_rng(0), [1, 9, 3, 1], num_heads=8, num_kv_heads=4,
                       head_dim=16, page_size=4, pages_per_seq=6)
    q, kp, vp, *meta = case.args()
    kp = jax.device_put(kp, NamedSharding(mesh, P("tensor")))  # pool sharded by KV head
    vp = jax.device_put(vp, NamedSharding(mesh, P("tensor")))
    kw = dict(sm_scale=0.25, max_q_len=case.max_q_len)
    got = jax.jit(lambda *a: api.sharded_ragged_paged_attention(mesh, *a, **kw))(q, kp, vp, *meta)
    want = reference.ragged_paged_attention(*case.args(), **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    # the stacked pool [L, KVH, ...] sharded on its KV-head axis, read at a traced layer index
    ks = jax.device_put(jnp.stack([0 * kp, kp]), NamedSharding(mesh, P(None, "tensor")))
    vs = jax.device_put(jnp.stack([0 * vp, vp]), NamedSharding(mesh, P(None, "tensor")))
    for impl in ("reference", "live_pages", "pallas_gpu_interpret"):
        fn = jax.jit(lambda li, *a: api.sharded_ragged_paged_attention(mesh, *a, layer=li, implementation=impl, **kw))
        np.testing.assert_allclose(np.asarray(fn(jnp.int32(1), q, ks, vs, *meta)), np.asarray(want), atol=1e-5)
    print("SHARDED_OK", got.sharding.spec)
""")


def test_sharded_attention_over_tensor_axis_matches_reference():
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    here = os.path.dirname(__file__)
    env["PYTHONPATH"] = os.pathsep.join([here, os.path.dirname(here), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _SHARDED], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "SHARDED_OK" in out.stdout


TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny_test.yaml")


def test_preflight_checks_attention_impl_before_any_work():
    """The YAML loads anywhere; the machine check (``train.preflight.prepare``, run by every entry
    point before any work) rejects an implementation this backend cannot run."""
    from rhyme_jax.config import ConfigError, load_config
    from rhyme_jax.train.preflight import prepare

    if jax.default_backend() != "cpu":
        pytest.skip("CPU dispatch rules")
    cfg = load_config(TINY, ["rollout.attention_impl=pallas_tpu"])
    with pytest.raises(ConfigError, match="rollout.attention_impl: .*needs backend"):
        prepare(cfg)
    cfg = prepare(load_config(TINY, ["rollout.attention_impl=pallas_gpu_interpret,reference"]))
    assert api.resolve_name(api.parse_implementation(cfg.rollout.attention_impl)) == "pallas_gpu_interpret"
    with pytest.warns(UserWarning, match="falling back"):
        assert api.resolve_name(api.parse_implementation("pallas_gpu, reference")) == "reference"


def _tiny_batch(dtype=np.float32, layers: int | None = None):
    """Two sequences (q_lens 1 and 4, page size 4, H 4, KVH 2, hd 16); with ``layers`` the pools
    are stacked ``[layers, KVH, P, ps, hd]``, each layer different."""
    rng = np.random.default_rng(0)
    kv_lens, q_lens, ps = np.array([5, 12]), np.array([1, 4]), 4
    lead = () if layers is None else (layers,)
    q = rng.standard_normal((int(q_lens.sum()), 4, 16))
    k_pages = rng.standard_normal(lead + (2, 9, ps, 16))
    v_pages = rng.standard_normal(lead + (2, 9, ps, 16))
    pages = np.array([[1, 2, 0, 0], [3, 4, 5, 0]], np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return (jnp.asarray(q, dtype), jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype),
            kv_lens.astype(np.int32), pages, cu, np.array([2], np.int32))


def test_default_tiling_by_dtype_and_query_length(monkeypatch):
    """Without ``block_sizes`` the GPU kernel gets 16 query rows per program for decode
    (max_q_len 1), 64 for bf16 verify / prefill and 16 for f32 ones (64 f32 rows spill
    registers); an explicit tiling is kept."""
    assert api.default_block_sizes(1, jnp.float32) == api.default_block_sizes(1, jnp.bfloat16) == api.BlockSizes()
    assert api.default_block_sizes(1, jnp.bfloat16).gpu.block_q == api.GPU_DECODE_BLOCK_Q == 16
    assert api.default_block_sizes(9, jnp.bfloat16).gpu.block_q == 64
    assert api.default_block_sizes(9, jnp.float32).gpu.block_q == 16
    assert api.default_block_sizes(512, jnp.float32).gpu.block_q == 16
    seen = []
    impl = api._IMPLEMENTATIONS["pallas_gpu_interpret"]

    def spy(*args, block_sizes, **kw):  # runs the kernel on the first call only (interpret is slow)
        seen.append((args[0].dtype.name, block_sizes.block_q))
        return impl.fn(*args, block_sizes=block_sizes, **kw) if len(seen) == 1 else jnp.zeros_like(args[0])

    monkeypatch.setitem(api._IMPLEMENTATIONS, "pallas_gpu_interpret", dataclasses.replace(impl, fn=spy))
    args = _tiny_batch()
    want = api.ragged_paged_attention(*args, sm_scale=0.25, max_q_len=4, implementation="reference")
    got = api.ragged_paged_attention(*args, sm_scale=0.25, max_q_len=4, implementation="pallas_gpu_interpret")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOLERANCE[jnp.float32])
    api.ragged_paged_attention(*args, sm_scale=0.25, max_q_len=4, implementation="pallas_gpu_interpret",
                               block_sizes=api.BlockSizes(gpu=pallas_gpu.GPUBlockSizes(block_q=32)))
    api.ragged_paged_attention(*_tiny_batch(jnp.bfloat16), sm_scale=0.25, max_q_len=4,
                               implementation="pallas_gpu_interpret")
    assert seen == [("float32", 16), ("float32", 32), ("bfloat16", 64)]


@pytest.mark.parametrize("impl", ["reference", "pallas_gpu_interpret"])
def test_stacked_pool_with_layer_index_equals_that_layer(impl):
    """``layer=`` on the stacked pool (a traced index under jit, as in the layer scan) gives the
    same output as that layer's pool alone, bit for bit (same arithmetic on the same values)."""
    args = _tiny_batch(layers=3)
    kw = dict(sm_scale=0.25, max_q_len=4, implementation=impl)
    fn = jax.jit(lambda layer, *a: api.ragged_paged_attention(*a, layer=layer, **kw))
    for layer in (0, 2):
        want = api.ragged_paged_attention(args[0], args[1][layer], args[2][layer], *args[3:], **kw)
        np.testing.assert_array_equal(np.asarray(fn(jnp.int32(layer), *args)), np.asarray(want))
