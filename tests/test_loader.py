"""Checkpoint loading errors, config errors, save/load round trip, bf16 checkpoints."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from _hf_fixtures import hf_logits, save_hf_model
from rhyme_jax.model.config import ModelConfig, ModelConfigError
from rhyme_jax.model.loader import CheckpointFormatError, load_hf_checkpoint, save_hf_checkpoint
from rhyme_jax.model.transformer import Decoder

import f32

TINY = ModelConfig(family="qwen2", vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=8, eos_token_ids=(5,))


def _write(directory, cfg: ModelConfig, tensors: dict):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    save_file(tensors, str(directory / "model.safetensors"))


@pytest.fixture()
def good(tmp_path):
    model = Decoder(TINY, rngs=nnx.Rngs(0))
    save_hf_checkpoint(model, tmp_path / "good")
    return model, load_file(str(tmp_path / "good" / "model.safetensors"))


def test_missing_key(tmp_path, good):
    _, tensors = good
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    _write(tmp_path / "ck", TINY, tensors)
    with pytest.raises(CheckpointFormatError, match=r"missing key 'model\.layers\.1\.self_attn\.k_proj\.bias'"):
        load_hf_checkpoint(tmp_path / "ck")


def test_unexpected_key(tmp_path, good):
    _, tensors = good
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(32, np.float32)
    _write(tmp_path / "ck", TINY, tensors)
    with pytest.raises(CheckpointFormatError,
                       match=r"unexpected key 'model\.layers\.0\.self_attn\.o_proj\.bias' in model\.safetensors"):
        load_hf_checkpoint(tmp_path / "ck")


def test_wrong_shape(tmp_path, good):
    _, tensors = good
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((32, 48), np.float32)
    _write(tmp_path / "ck", TINY, tensors)
    with pytest.raises(CheckpointFormatError,
                       match=r"shape mismatch for 'model\.layers\.0\.mlp\.up_proj\.weight'.*\[32, 48\].*\[48, 32\]"):
        load_hf_checkpoint(tmp_path / "ck")


def test_ignorable_keys_and_no_files(tmp_path, good):
    _, tensors = good
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    _write(tmp_path / "ck", TINY, tensors)
    load_hf_checkpoint(tmp_path / "ck")  # old checkpoints carry inv_freq buffers: ignored
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    with pytest.raises(CheckpointFormatError, match="no \\*.safetensors"):
        load_hf_checkpoint(tmp_path / "empty")


def test_sharded_checkpoint(tmp_path, good):
    model, tensors = good
    keys = sorted(tensors)
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    save_file({k: tensors[k] for k in keys[:10]}, str(d / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in keys[10:]}, str(d / "model-00002-of-00002.safetensors"))
    _, loaded = load_hf_checkpoint(d)
    np.testing.assert_array_equal(np.asarray(loaded.layers.mlp.down_proj.kernel[...][1]),
                                  np.asarray(model.layers.mlp.down_proj.kernel[...][1]))


@pytest.mark.parametrize("field,value,pattern", [
    ("model_type", "gpt2", "'model_type'='gpt2'"),
    ("hidden_size", None, "'hidden_size' is missing"),
    ("num_hidden_layers", "two", "'num_hidden_layers'='two' must be an int"),
    ("num_key_value_heads", 3, "'num_kv_heads'=3 must divide"),
    ("hidden_act", "gelu", "'hidden_act'"),
])
def test_bad_config(tmp_path, field, value, pattern):
    d = TINY.to_hf_dict()
    if value is None:
        del d[field]
    else:
        d[field] = value
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ModelConfigError, match="config.json") as info:
        load_hf_checkpoint(tmp_path)
    assert pattern in str(info.value)


def test_config_formats():
    old = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 5e5, "eos_token_id": [7, 8],
           "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    cfg = ModelConfig.from_hf_dict(old)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta, cfg.eos_token_ids) == (4, 2, 5e5, (7, 8))
    assert cfg.rope_scaling_dict["factor"] == 32.0 and cfg.rope_scaling_dict["rope_type"] == "llama3"
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    hash(cfg)  # static-argument friendly
    with pytest.raises(ModelConfigError, match="rope_scaling.rope_type'='yarn'"):
        ModelConfig.from_hf_dict({**old, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    with pytest.raises(ModelConfigError, match="rope_scaling.high_freq_factor' is missing"):
        ModelConfig.from_hf_dict({**old, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                          "original_max_position_embeddings": 8192}})


@pytest.mark.parametrize("family,tied", [("qwen2", False), ("qwen3", True), ("llama", False)])
def test_save_load_round_trip_is_exact(tmp_path, family, tied):
    cfg = TINY.replace(family=family, tie_word_embeddings=tied,
                       rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                                     ("original_max_position_embeddings", 64), ("rope_type", "llama3"))
                       if family == "llama" else None)
    model = Decoder(cfg, rngs=nnx.Rngs(1))
    save_hf_checkpoint(model, tmp_path)
    cfg2, loaded = load_hf_checkpoint(tmp_path)
    assert cfg2 == cfg
    a, b = nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(loaded))
    assert [p for p, _ in a] == [p for p, _ in b]
    for (path, va), (_, vb) in zip(a, b):
        np.testing.assert_array_equal(np.asarray(va[...]), np.asarray(vb[...]), err_msg=str(path))


def test_saved_checkpoint_loads_in_transformers(tmp_path):
    """HF export: transformers reads our files and computes the same logits."""
    import transformers as tf

    cfg = TINY.replace(family="qwen3", tie_word_embeddings=False)
    model = Decoder(cfg, rngs=nnx.Rngs(2))
    save_hf_checkpoint(model, tmp_path)
    hf = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    tokens = np.random.default_rng(0).integers(0, 96, (1, 12))
    ours = np.asarray(model(jnp.asarray(tokens), jnp.arange(12)[None]))
    ref = hf_logits(hf, tokens)  # JAX vs torch: f32's worst-case bound for this depth and width
    np.testing.assert_allclose(ours, ref, atol=f32.logits_between_programs(cfg, 12, ref), rtol=0)


def test_bf16_checkpoint_loads(tmp_path):
    import torch

    hf = save_hf_model("qwen2", tmp_path / "f32", tied=True)
    hf.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    cfg, model = load_hf_checkpoint(tmp_path / "bf16", dtype=jnp.bfloat16)
    kernel = model.layers.attn.q_proj.kernel[...][0]
    assert kernel.dtype == jnp.bfloat16
    ref = hf.model.layers[0].self_attn.q_proj.weight.detach().float().numpy().T
    np.testing.assert_array_equal(np.asarray(kernel.astype(jnp.float32)), ref)  # bf16 -> bf16 exact
    # upcast load: bf16 file into f32 params
    _, model32 = load_hf_checkpoint(tmp_path / "bf16", dtype=jnp.float32)
    assert model32.embed.embedding[...].dtype == jnp.float32
    tokens = np.random.default_rng(0).integers(0, 128, (1, 10))
    ref_logits = hf_logits(hf.float(), tokens)
    got = np.asarray(model32(jnp.asarray(tokens), jnp.arange(10)[None]))
    np.testing.assert_allclose(got, ref_logits, atol=f32.logits_between_programs(cfg, 10, ref_logits), rtol=0)
    got16 = np.asarray(model(jnp.asarray(tokens), jnp.arange(10)[None]))
    assert got16.dtype == np.float32 and np.abs(got16 - ref_logits).max() < 0.1
