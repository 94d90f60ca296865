"""``train.export.export_hf``: a run's checkpoint as a HF directory that transformers loads with the
same logits as rhyme-jax's forward (tiny random Llama / Qwen2 / Qwen3 sources, the demo's tiny
model, a bf16 source), and the errors raised before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from _hf_fixtures import save_hf_model
from rhyme_jax.config import ConfigError, load_config, to_yaml
from rhyme_jax.io.checkpoint import Checkpointer, save_params
from rhyme_jax.model.config import ModelConfigError
from rhyme_jax.model.loader import load_hf_checkpoint
from rhyme_jax.model.tokenizer import Tokenizer, train_demo_tokenizer
from rhyme_jax.model.transformer import Decoder
from rhyme_jax.train.export import EXPORT_MARKER, ExportError, export_hf

import f32
from rhyme_jax.train.policy import tiny_model_config

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

TEXTS = [f"{a} + {b} = {a + b}\nWhat is {a} times {b}? #### {a * b}" for a in range(12) for b in range(12)]
CHAT = "<|user|>\n{question}\n<|assistant|>\n"  # also exercises the chat template copy


def _source_dir(tmp_path, family: str, *, tied: bool, dtype: str = "float32"):
    """A tiny random HF checkpoint with a demo tokenizer (vocab <= 128) and tokenizer side files."""
    src = tmp_path / f"src_{family}"
    hf = save_hf_model(family, src, tied=tied)
    if dtype == "bfloat16":
        hf.to(torch.bfloat16).save_pretrained(str(src), safe_serialization=True)
    train_demo_tokenizer(TEXTS, 100, src / "tokenizer.json")
    (src / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "pad_token": "<pad>",
         "unk_token": "<unk>"}))
    (src / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return src


def _run_dir(tmp_path, model_path: str, *overrides) -> Path:
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    cfg = load_config(None, [f"model.path={json.dumps(model_path)}", f"run.runs_dir={tmp_path / 'runs'}", "run.name=r",
                             *overrides])
    (run / "config.yaml").write_text(to_yaml(cfg))
    return run


def _perturbed(state, seed: int):
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
                                        for x, k in zip(leaves, keys)])


def _save_step(run, step: int, state) -> None:
    with Checkpointer(run / "checkpoints") as c:
        c.save(step, params=state, opt_state=(), meta={"step": step})


def _ours(model_cfg, state, tokens: np.ndarray) -> np.ndarray:
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(model_cfg, rngs=nnx.Rngs(0))))
    pos = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    return np.asarray(nnx.merge(graphdef, state)(tokens, pos))


def _theirs(out_dir, tokens: np.ndarray) -> np.ndarray:
    hf = tf.AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_export_matches_rhyme_jax_forward(tmp_path, family, tied):
    src = _source_dir(tmp_path, family, tied=tied)
    model_cfg, model = load_hf_checkpoint(src)
    state = _perturbed(nnx.state(model), seed=1)
    run = _run_dir(tmp_path, str(src), f"model.prompt_template={json.dumps(CHAT)}")
    _save_step(run, 3, nnx.state(model))
    _save_step(run, 5, state)  # the latest: exported by default
    out = export_hf(run, tmp_path / "out")

    tokens = np.random.default_rng(0).integers(0, model_cfg.vocab_size, (2, 13))
    got = _theirs(out, tokens)
    want = _ours(model_cfg, state, tokens)  # torch vs JAX: f32's worst-case bound
    np.testing.assert_allclose(got, want, atol=f32.logits_between_programs(model_cfg, 13, want), rtol=0)
    # Not the source weights: the test fails if export wrote the original checkpoint.
    assert np.abs(got - _theirs(src, tokens)).max() > 1e-2
    exported, original = load_file(str(out / "model.safetensors")), load_file(str(src / "model.safetensors"))
    assert set(exported) == set(original) and ("lm_head.weight" in exported) == (not tied)
    assert all(exported[k].dtype == np.float32 and exported[k].shape == original[k].shape for k in exported)

    for name in ("config.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    tok = tf.AutoTokenizer.from_pretrained(str(out))
    text = TEXTS[7]
    assert tok(text, add_special_tokens=False)["input_ids"] == Tokenizer.from_file(src).encode(text)
    marker = json.loads((out / EXPORT_MARKER).read_text())
    assert marker["checkpoint"] == "step 5" and marker["prompt_template"] == CHAT


def test_export_step_and_initial(tmp_path):
    src = _source_dir(tmp_path, "llama", tied=True)
    model_cfg, model = load_hf_checkpoint(src)
    run = _run_dir(tmp_path, str(src))
    _save_step(run, 3, _perturbed(nnx.state(model), seed=3))
    _save_step(run, 5, _perturbed(nnx.state(model), seed=5))
    step3 = load_file(str(export_hf(run, tmp_path / "s3", step=3) / "model.safetensors"))
    latest = load_file(str(export_hf(run, tmp_path / "s5") / "model.safetensors"))
    assert not np.array_equal(step3["model.norm.weight"], latest["model.norm.weight"])
    # step="initial" with no SFT warm start: the source weights, exactly.
    initial = load_file(str(export_hf(run, tmp_path / "init", step="initial") / "model.safetensors"))
    original = load_file(str(src / "model.safetensors"))
    assert all(np.array_equal(initial[k], original[k]) for k in original)
    # ... and with one: <run>/sft/params.
    sft = _perturbed(nnx.state(model), seed=7)
    save_params(run / "sft" / "params", sft)
    warm = load_file(str(export_hf(run, tmp_path / "warm", step="initial") / "model.safetensors"))
    np.testing.assert_array_equal(warm["model.norm.weight"], np.asarray(sft["final_norm"]["weight"][...]))
    # overwrite replaces a finished export.
    export_hf(run, tmp_path / "s5", step=3, overwrite=True)
    assert json.loads((tmp_path / "s5" / EXPORT_MARKER).read_text())["checkpoint"] == "step 3"


def test_export_bf16_source_keeps_its_dtype(tmp_path):
    src = _source_dir(tmp_path, "qwen2", tied=False, dtype="bfloat16")
    model_cfg, model = load_hf_checkpoint(src, param_dtype=np.float32)
    state = _perturbed(nnx.state(model), seed=2)
    run = _run_dir(tmp_path, str(src))
    _save_step(run, 1, state)
    out = export_hf(run, tmp_path / "out")
    tensors = load_file(str(out / "model.safetensors"))
    assert {str(t.dtype) for t in tensors.values()} == {"bfloat16"}
    want = np.asarray(state["layers"]["mlp"]["up_proj"]["kernel"][...])[1].T
    np.testing.assert_array_equal(tensors["model.layers.1.mlp.up_proj.weight"],
                                  want.astype(tensors["model.layers.1.mlp.up_proj.weight"].dtype))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_export_tiny_demo_model(tmp_path):
    template = json.dumps("Q: {question}\nA:")
    tiny = ["model.tiny.family=qwen3", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=48",
            "model.tiny.num_layers=2", "model.tiny.num_heads=4", "model.tiny.num_kv_heads=2",
            "model.tiny.head_dim=16", "model.tiny.tie_word_embeddings=true",
            f"model.prompt_template={template}"]
    run = _run_dir(tmp_path, "", *tiny)
    tokenizer = train_demo_tokenizer(TEXTS, 100, run / "tokenizer.json")
    cfg = load_config(run / "config.yaml")
    model = Decoder(tiny_model_config(cfg, tokenizer), rngs=nnx.Rngs(0))  # the layout build_model makes
    state = _perturbed(nnx.state(model), seed=4)
    _save_step(run, 2, state)
    out = export_hf(run, tmp_path / "out")

    tokens = np.asarray([tokenizer.encode(TEXTS[20])])
    got = _theirs(out, tokens)
    want = _ours(model.cfg, state, tokens)  # torch vs JAX: f32's worst-case bound
    np.testing.assert_allclose(got, want, atol=f32.logits_between_programs(model.cfg, tokens.shape[1], want), rtol=0)
    assert np.abs(got - _ours(model.cfg, nnx.state(model), tokens)).max() > 1e-2
    tok = tf.AutoTokenizer.from_pretrained(str(out))
    assert tok.eos_token == "<eos>" and tok.pad_token_id == tokenizer.pad_id
    assert tok(TEXTS[20], add_special_tokens=False)["input_ids"] == tokens[0].tolist()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == cfg.model.prompt_template.format(question="What is 2 + 3?")


def test_errors_name_the_path_and_write_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ExportError, match=f"{tmp_path / 'nope'}: run directory not found"):
        export_hf(tmp_path / "nope", out)
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(ExportError, match="config.yaml: not found"):
        export_hf(bare, out)

    src = _source_dir(tmp_path, "llama", tied=True)
    run = _run_dir(tmp_path, str(src))
    with pytest.raises(ExportError, match=f"{run / 'checkpoints'}: no complete checkpoint"):
        export_hf(run, out)
    assert not (run / "checkpoints").exists()  # reading never creates the checkpoint directory
    _save_step(run, 4, nnx.state(load_hf_checkpoint(src)[1]))
    with pytest.raises(ExportError, match=r"no complete checkpoint for step 9 \(have \[4\]\)"):
        export_hf(run, out, step=9)
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ExportError, match=f"{out}: already exists and is not empty"):
        export_hf(run, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]

    hf = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**hf, "model_type": "gpt2"}))
    with pytest.raises(ModelConfigError, match=f"{src / 'config.json'}: field 'model_type'='gpt2'"):
        export_hf(run, tmp_path / "out2")
    (run / "config.yaml").write_text("model:\n  nonsense: 1\n")
    with pytest.raises(ConfigError, match="config.yaml"):
        export_hf(run, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no staging left behind


def test_export_carries_the_runs_chat_template_file(tmp_path):
    src = _source_dir(tmp_path, "llama", tied=True)
    _, model = load_hf_checkpoint(src)
    jinja = tmp_path / "mine.jinja"
    jinja.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                     "{% if add_generation_prompt %}<a>{% endif %}")
    run = _run_dir(tmp_path, str(src), f"model.chat_template={jinja}", "model.system_prompt=Be brief.")
    _save_step(run, 1, nnx.state(model))
    out = export_hf(run, tmp_path / "out")
    assert (out / "chat_template.jinja").read_text() == jinja.read_text()  # replaces the source's
    meta = json.loads((out / EXPORT_MARKER).read_text())
    assert (meta["chat_template"], meta["system_prompt"]) == (str(jinja), "Be brief.")
    tok = tf.AutoTokenizer.from_pretrained(str(out))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == "<system>Be brief.<user>2+3?<a>"
