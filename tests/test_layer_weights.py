"""Per-layer rollout weights (``rollout/layer_weights.py``, ``EngineConfig.layer_weights``): the
split layout holds each block's parameter rows, the engine on it emits the tokens of the engine
that scans the stacked weights, and bad layouts fail at construction."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rhyme_jax.rollout.engine import EngineConfig, EngineConfigError, SamplingParams
from pallas_kernels.ragged_paged_attention import api
from rhyme_jax.rollout.layer_weights import SPLIT_MIN_LAYER_BYTES, LayerSplit, layer_bytes, split_layers, use_split
from test_rollout_engine import CFG, MAX_NEW, _engine, _model, _prompts, logprob_atol


def test_split_holds_each_blocks_rows():
    """Block ``i`` of the split is row ``i`` of every stacked leaf; the rest is the state's own."""
    state = _model()[1]
    split = split_layers(state)
    assert isinstance(split, LayerSplit) and len(split.layers) == CFG.num_layers
    assert "layers" not in split.top and set(split.top) == set(state) - {"layers"}
    stacked = jax.tree.leaves(state["layers"])
    for i, block in enumerate(split.layers):
        for got, want in zip(jax.tree.leaves(block), stacked, strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want[i]))
    abstract = split_layers(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state))
    assert [x.shape for x in jax.tree.leaves(abstract)] == [x.shape for x in jax.tree.leaves(split)]
    with pytest.raises(KeyError, match="layers"):
        split_layers(split.top)


@pytest.mark.parametrize("passes", [1, 4])
def test_split_engine_emits_the_stacked_engines_tokens(passes):
    """Sampled (T = 1), per-pass and 4 passes a dispatch: the same tokens and finish reasons;
    the logprobs within the float32 bound of two programs."""
    state, prompts = _model()[1], _prompts(1)
    sp = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW)
    runs = {lw: _engine(layer_weights=lw, passes_per_dispatch=passes).generate(state, prompts, sp, jax.random.key(5))
            for lw in ("split", "stacked")}
    atol = logprob_atol(prompts, runs["stacked"].tokens)
    assert runs["split"].finish_reasons == runs["stacked"].finish_reasons
    for got, want, glp, wlp in zip(runs["split"].tokens, runs["stacked"].tokens, runs["split"].logprobs,
                                   runs["stacked"].logprobs, strict=True):
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(glp, wlp, atol=atol, rtol=0)


def test_layout_choice_and_errors():
    """``auto`` splits on the CPU backend only, blocks of at least ``SPLIT_MIN_LAYER_BYTES`` (not
    the test model's); an unknown layout is refused by name."""
    state = _model()[1]
    big = {"layers": {"w": jax.ShapeDtypeStruct((3, SPLIT_MIN_LAYER_BYTES // 4), jnp.float32)}}
    assert layer_bytes(big) == SPLIT_MIN_LAYER_BYTES and layer_bytes(state) < SPLIT_MIN_LAYER_BYTES
    assert use_split("split", state) and not use_split("stacked", big)
    assert not use_split("auto", state)
    assert use_split("auto", big) == (jax.default_backend() == "cpu")
    with api.target_backend("gpu"):
        assert not use_split("auto", big)
    with pytest.raises(ValueError, match="layer_weights='scan'"):
        use_split("scan")
    with pytest.raises(EngineConfigError, match="layer_weights"):
        EngineConfig(max_slots=1, page_size=4, max_prompt_len=4, max_new_tokens=4, layer_weights="scan")


def test_bf16_engine_splits_the_cast_weights():
    """With ``dtype=bfloat16`` the per-layer leaves the passes take are the cast ones."""
    state = _model()[1]
    leaves, _ = _engine(layer_weights="split", dtype="bfloat16")._flat_state(state)
    assert {x.dtype for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)} == {jnp.dtype(jnp.bfloat16)}
    per_block = len(jax.tree.leaves(state["layers"]))
    assert len(leaves) == len(jax.tree.leaves(state)) - per_block + CFG.num_layers * per_block


def test_rollout_weights_are_made_once_per_weight_version():
    """Two ``generate`` calls on the same weights split them once and sample the same tokens; a new
    weight version is split again, and the old copy is dropped once its weights are freed."""
    import gc
    from rhyme_jax.rollout.run_weights import ROLLOUT_WEIGHTS
    state, prompts = _model()[1], _prompts(1)
    sp = SamplingParams(temperature=1.0, max_new_tokens=8)
    eng = _engine(layer_weights="split")
    ROLLOUT_WEIGHTS.clear()
    made = ROLLOUT_WEIGHTS.made
    first, again = (eng.generate(state, prompts, sp, jax.random.key(3)) for _ in range(2))
    assert ROLLOUT_WEIGHTS.made == made + 1 and len(ROLLOUT_WEIGHTS) == 1
    for a, b in zip(first.tokens, again.tokens, strict=True):
        np.testing.assert_array_equal(a, b)
    newer = jax.tree.map(lambda x: x + 0, state)
    eng.generate(newer, prompts, sp, jax.random.key(3))
    assert ROLLOUT_WEIGHTS.made == made + 2 and len(ROLLOUT_WEIGHTS) == 2
    del newer
    gc.collect()
    assert len(ROLLOUT_WEIGHTS) == 1
    ROLLOUT_WEIGHTS.clear()


def test_weight_cache_misses_deleted_sources_and_keeps_no_uncopied_state():
    """A donated (deleted) source is never served from the cache; a preparation that copies nothing
    is not kept (it would hold the source alive); the oldest copy leaves first past capacity."""
    from rhyme_jax.rollout.run_weights import WeightCache, rollout_weights
    cache = WeightCache(capacity=2)
    src = {"w": jnp.arange(4.0)}
    copy = lambda s: ({"w": s["w"] * 2}, True)  # noqa: E731
    a = cache.get(src, "t", copy)
    assert cache.get(src, "t", copy) is a and cache.made == 1
    assert cache.get(src, "other", copy) is not a and cache.made == 2
    others = [{"w": jnp.ones(2)} for _ in range(2)]
    for o in others:
        cache.get(o, "t", copy)
    assert len(cache) == 2 and cache.get(src, "t", copy) is not a  # evicted: made again
    src["w"].delete()
    made = cache.made
    with pytest.raises(RuntimeError):  # made again (the deleted array is read), never served stale
        cache.get(src, "t", copy)
    assert cache.made == made
    state = _model()[1]
    same = rollout_weights(state, None, "stacked", cache)
    assert all(x is y for x, y in zip(jax.tree.leaves(same), jax.tree.leaves(state), strict=True))
    assert not any(k[0] == (None, "stacked") for k in cache._entries)
    with pytest.raises(ValueError):
        WeightCache(capacity=0)
