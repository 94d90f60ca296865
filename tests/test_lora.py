"""LoRA (model/lora.py, train/lora_state.py, train/lora_export.py) against PEFT on tiny HF models."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from _hf_fixtures import hf_logits, save_hf_model
from rhyme_jax.config import ConfigError, load_config
from rhyme_jax.model import lora
from rhyme_jax.model.loader import load_hf_checkpoint
from rhyme_jax.train.lora_export import ADAPTER_CONFIG, peft_state_dict, write_peft_adapter
from rhyme_jax.train.state_memory import state_memory

import f32

peft = pytest.importorskip("peft")

CONFIG = "configs/tiny_test.yaml"
# (family, targets, rank, alpha): a subset on qwen2 (biases), PEFT's "all-linear" on qwen3 (qk-norm).
CASES = [("qwen2", ("q_proj", "v_proj", "down_proj"), 4, 8.0), ("qwen3", tuple(lora.TARGETS), 3, 5.0)]


def lora_tol(cfg, rank: int, seq_len: int, ref) -> float:
    """JAX vs torch logits of an adapted model: the ``f32.forward`` bound of the decoder with every
    projection's reduction lengthened by ``rank + 2`` (``x W + s (x A) B``: the adapter's second
    product sums ``rank`` terms, then one scale and one add; its first product has the projection's
    own length), for both programs (``between_programs``), at the reference's largest |logit|."""
    hd, h, d, m = cfg.head_dim, cfg.num_heads, cfg.hidden_size, cfg.intermediate_size
    extra = rank + 2
    layer = [d, d + extra, hd, seq_len, seq_len, h * hd + extra, d, d + extra, m + extra]
    widths = layer * cfg.num_layers + [d, d]
    return f32.between_programs(f32.forward(widths, float(np.abs(ref).max())))


def peft_model(hf, targets, rank, alpha, seed=0):
    """``peft.get_peft_model`` of ``hf`` with random (nonzero) A and B in every adapter."""
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets),
                             task_type="CAUSAL_LM")
    model = peft.get_peft_model(hf, config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model


def adapters_from_peft(model, abstract: nnx.State) -> nnx.State:
    """Our stacked adapters holding ``model``'s PEFT weights (``A[i] = lora_A.weight.T``)."""
    layers = model.base_model.model.model.layers
    out = []
    for path, var in nnx.to_flat_state(abstract):
        _, parent, name, _, which = path
        key = "lora_A" if which == "lora_a" else "lora_B"
        rows = [getattr(getattr(getattr(layer, lora.HF_PARENT[parent]), name), key)["default"].weight
                for layer in layers]
        out.append((path, var.replace(value=jnp.asarray(np.stack([r.detach().numpy().T for r in rows])))))
    return nnx.from_flat_state(out)


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def pair(request, tmp_path_factory):
    family, targets, rank, alpha = request.param
    directory = tmp_path_factory.mktemp(family)
    save_hf_model(family, directory, tied=family == "qwen3")
    cfg, base = load_hf_checkpoint(directory)
    hf = peft_model(save_hf_model(family, directory / "copy", tied=family == "qwen3"), targets, rank, alpha)
    spec = lora.LoRASpec(rank, alpha, 0.0, targets)
    graphdef, abstract, keys, _ = lora.split_lora(lora.lora_decoder(cfg, spec))
    assert not jax.tree.leaves(keys)  # no dropout: no keys
    return dict(cfg=cfg, base=base, hf=hf, spec=spec, graphdef=graphdef, adapters=adapters_from_peft(hf, abstract),
                directory=directory)


def _forward(model, tokens):
    b, t = tokens.shape
    return np.asarray(model(jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))))


def test_adapted_forward_matches_peft(pair):
    """The LoRA decoder (base params + adapters, unmerged) gives PEFT's logits on the same
    weights, and so does the merged ``Decoder`` the rollout engine runs (``merge_adapters``)."""
    cfg, spec = pair["cfg"], pair["spec"]
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 19))
    ref = hf_logits(pair["hf"], tokens)
    base_graphdef, base = nnx.split(pair["base"])
    adapted = _forward(nnx.merge(pair["graphdef"], base, pair["adapters"]), tokens)
    tol = lora_tol(cfg, spec.rank, 19, ref)
    np.testing.assert_allclose(adapted, ref, atol=tol, rtol=0)
    with torch.no_grad(), pair["hf"].disable_adapter():
        plain = pair["hf"](input_ids=torch.as_tensor(tokens)).logits.numpy()
    assert np.abs(plain - ref).max() > 100 * tol  # the adapters matter: the comparison is not vacuous


def test_merged_weights_match_peft(pair):
    """The merged ``Decoder`` params the rollout engine and the export get (``merge_adapters``:
    ``W + (alpha / r) A B``) give PEFT's adapted logits."""
    cfg, spec = pair["cfg"], pair["spec"]
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 19))
    ref = hf_logits(pair["hf"], tokens)
    base_graphdef, base = nnx.split(pair["base"])
    merged_state = lora.merge_adapters(base, pair["adapters"], spec.scale)
    merged = _forward(nnx.merge(base_graphdef, merged_state), tokens)
    np.testing.assert_allclose(merged, ref, atol=lora_tol(cfg, spec.rank, 19, ref), rtol=0)


def test_written_adapters_load_in_peft(pair, tmp_path):
    """``write_peft_adapter``'s files load with ``peft.PeftModel.from_pretrained`` onto the base
    model and give the adapted logits; the key names are PEFT's."""
    cfg, spec = pair["cfg"], pair["spec"]
    write_peft_adapter(tmp_path, spec, cfg, pair["adapters"])
    names = peft_state_dict(cfg, pair["adapters"])
    assert "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight" in names
    assert names["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"].shape == (cfg.hidden_size, spec.rank)
    assert json.loads((tmp_path / ADAPTER_CONFIG).read_text())["lora_alpha"] == spec.alpha
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(str(pair["directory"]), dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path)).eval()
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 13))
    ref = hf_logits(pair["hf"], tokens)
    got = hf_logits(loaded, tokens)
    np.testing.assert_allclose(got, ref, atol=lora_tol(cfg, spec.rank, 13, ref), rtol=0)


def test_merge_adapters_hand_computed():
    """``merge_adapters`` replaces an adapted kernel by ``W + scale A B`` (one layer, rank 1:
    ``A B`` is the outer product) and leaves every other leaf as it was."""
    w = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    base = nnx.State({"layers": {"attn": {"q_proj": {"kernel": nnx.Param(jnp.asarray(w))}},
                                 "input_norm": {"weight": nnx.Param(jnp.ones((1, 2)))}}})
    adapters = nnx.State({"layers": {"attn": {"q_proj": {"lora": {
        "lora_a": nnx.LoRAParam(jnp.asarray([[[1.0], [2.0]]])),
        "lora_b": nnx.LoRAParam(jnp.asarray([[[1.0, 0.0, -1.0]]]))}}}}})
    merged = lora.merge_adapters(base, adapters, 0.5)
    expect = w + 0.5 * np.array([[[1.0, 0.0, -1.0], [2.0, 0.0, -2.0]]], np.float32)
    np.testing.assert_array_equal(np.asarray(merged["layers"]["attn"]["q_proj"]["kernel"][...]), expect)
    np.testing.assert_array_equal(np.asarray(merged["layers"]["input_norm"]["weight"][...]), np.ones((1, 2)))


def test_dropout_acts_on_the_adapter_input_only():
    """With dropout, ``LoRALinear`` is ``x W + b + scale (m * x / (1 - p)) A B`` with ``m`` the
    Bernoulli(1 - p) keep mask of its key (inverted dropout, as torch.nn.Dropout in PEFT)."""
    spec = lora.LoRASpec(2, 4.0, 0.5, ("q_proj",))
    layer = lora.LoRALinear(6, 5, spec=spec, target_id=0, use_bias=True, dtype=jnp.float32,
                            param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    layer.lora.lora_b[...] = jax.random.normal(jax.random.key(1), (2, 5))
    layer.dropout_key[...] = jax.random.key_data(jax.random.key(7))
    x = jax.random.normal(jax.random.key(2), (4, 6))
    keep = jax.random.bernoulli(jax.random.fold_in(jax.random.key(7), 0), 0.5, x.shape)
    a, b, w, bias = (np.asarray(v[...], np.float64) for v in (layer.lora.lora_a, layer.lora.lora_b, layer.kernel,
                                                                layer.bias))
    x64, m = np.asarray(x, np.float64), np.asarray(keep)
    expect = x64 @ w + bias + spec.scale * ((m * x64 / 0.5) @ a @ b)
    assert 0 < m.sum() < m.size
    np.testing.assert_allclose(np.asarray(layer(x)), expect, rtol=0, atol=f32.dot(12, float(np.abs(expect).max())) * 4)


def test_lora_config_errors_name_the_key():
    for override, key in (("lora.rank=-1", "lora.rank"), ("lora.dropout=1.0", "lora.dropout"),
                          ("lora.target_modules=[lm_head]", "lora.target_modules"),
                          ("lora.target_modules=[q_proj,q_proj]", "lora.target_modules"), ("lora.alpha=0", "lora.alpha")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(CONFIG, [override])
    assert lora.TARGETS.keys() == set(load_config(CONFIG, []).lora.target_modules)


def test_memory_plan_gives_optimizer_state_to_adapters_only():
    """``state_memory`` with LoRA: the trainable parameters are ``L x sum r (in + out)`` over the
    adapted projections; the AdamW moments are 2 x 4 bytes per trainable parameter (the counters
    are the same as in the full plan); params count base + adapters."""
    cfg = load_config(CONFIG, []).model.tiny
    from rhyme_jax.model.config import ModelConfig

    model_cfg = ModelConfig(family="qwen3", vocab_size=64, hidden_size=cfg.hidden_size,
                            intermediate_size=cfg.intermediate_size, num_layers=cfg.num_layers,
                            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                            qk_norm=True, tie_word_embeddings=True)
    spec = lora.LoRASpec(4, 8.0, 0.0, ("q_proj", "down_proj"))
    full = state_memory(model_cfg, {})
    adapted = state_memory(model_cfg, {}, lora=spec)
    d, q, m = model_cfg.hidden_size, model_cfg.num_heads * model_cfg.head_dim, model_cfg.intermediate_size
    trainable = model_cfg.num_layers * spec.rank * ((d + q) + (m + d))
    assert adapted["trainable_params"] == trainable
    assert adapted["params"] == full["params"] + trainable
    assert adapted["opt_bytes_total"] - 8 * trainable == full["opt_bytes_total"] - 8 * full["params"]


def _parity_reward(text, problem):
    return float(len(text) % 2)


def _host(tree):
    return [np.array(x) for x in jax.tree.leaves(tree)]


@pytest.mark.slow
def test_lora_run_trains_adapters_only_resumes_exactly_and_exports(tmp_path):
    """A 2-step tiny LoRA run (dropout on, KL on): the optimizer state holds adapter leaves only,
    the base params never change, the adapters do; resuming from step 1's checkpoint replays step 2
    bit for bit (adapters, optimizer state: the dropout keys follow the restored update counter);
    the export's merged model and its PEFT adapter on the base give the same logits."""
    import shutil

    import transformers

    from rhyme_jax.train.export import export_hf
    from rhyme_jax.train.trainer import GRPOTrainer

    over = [f"run.runs_dir={tmp_path}", "lora.rank=4", "lora.alpha=8", "lora.dropout=0.1", "sft.steps=0",
            "grpo.steps=2", "grpo.learning_rate=1e-2", "grpo.kl_coef=0.05", "run.keep_checkpoints=2"]
    trainer = GRPOTrainer(load_config(CONFIG, over), reward_fn=_parity_reward)
    try:
        paths = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(trainer.opt_state)
                 if np.ndim(x) > 0]
        assert paths and all("lora_a" in p or "lora_b" in p for p in paths)
        base0, adapters0 = _host(trainer.learner.ref_state), _host(trainer.state)
        trainer.fit()
        final, final_opt = _host(trainer.state), _host(trainer.opt_state)
        assert all(np.array_equal(a, b) for a, b in zip(base0, _host(trainer.learner.ref_state)))
        assert any(not np.array_equal(a, b) for a, b in zip(adapters0, final))
    finally:
        trainer.close()
    run_dir = trainer.run_dir
    shutil.rmtree(run_dir / "checkpoints" / "2")
    resumed = GRPOTrainer(load_config(CONFIG, over), reward_fn=_parity_reward, resume=True)
    try:
        assert resumed.step == 1
        resumed.fit()
        assert all(np.array_equal(a, b) for a, b in zip(final, _host(resumed.state)))
        assert all(np.array_equal(a, b) for a, b in zip(final_opt, _host(resumed.opt_state)))
    finally:
        resumed.close()
    out = export_hf(run_dir, tmp_path / "export")
    init = export_hf(run_dir, tmp_path / "initial", step="initial")
    tokens = np.random.default_rng(0).integers(0, 100, (1, 9))
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(str(init), dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, str(out / "adapter")).eval()
    ref = hf_logits(adapted, tokens)
    cfg, _ = load_hf_checkpoint(out)
    np.testing.assert_allclose(hf_logits(merged, tokens), ref, atol=lora_tol(cfg, 4, 9, ref), rtol=0)
