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
