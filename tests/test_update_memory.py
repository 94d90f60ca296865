"""Memory-bounded GRPO update: chunked log-probs, micro-batched gradient accumulation, remat.

Each bound must leave the numbers unchanged: the chunked log-probs / entropies and their
gradients equal the full-logits ones, and an update accumulated over micro-batches (with or
without per-block remat) equals the one-pass update.

Tolerances (tests/f32.py): the chunked / micro-batched / rematerialised programs compute the
same float32 values as the one-pass program in other reduction orders, so they differ by at most
twice one program's error (``f32.between_programs``). Log-probs over a 97-token vocabulary of
|logit| < 3 and a 2-layer width-32 model: ``f32.logprobs`` is below 1e-5 (``atol=1e-5``);
gradients and metrics are sums over 8 x 32 tokens of such terms, whose relative error is
``gamma(256) = 1.5e-5`` plus the per-token error, hence ``rtol=1e-4`` / ``1e-5`` on the
metrics; ``atol=2e-6`` on SGD-updated parameters is ``lr x`` that on gradients of size < 0.1.
A dropped micro-batch or a wrong weight changes the loss and gradient by far more (a share of
the rows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rhyme_jax.model.config import ModelConfig
from rhyme_jax.model.transformer import Decoder
from rhyme_jax.train import losses
from rhyme_jax.train.grpo_step import UpdateMemory, make_grpo_step, num_micro_batches

CFG = ModelConfig(family="qwen2", vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=False)


def _batch(rows=8, seq=24, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, 97, rng.integers(3, 8)).tolist() for _ in range(rows)]
    responses = [rng.integers(2, 97, rng.integers(0, 14)).tolist() for _ in range(rows)]
    b = losses.sequence_batch(prompts, responses, pad_id=0, max_len=seq)
    lps = [(-rng.random(len(r)) * 3).tolist() for r in responses]
    b["old_logprobs"] = losses.response_grid(lps, b.pop("prompt_lens"), b["tokens"].shape[1])
    b.pop("lengths")
    b["advantages"] = rng.normal(size=rows).astype(np.float32)
    return {k: jnp.asarray(v) for k, v in b.items()}


@pytest.mark.parametrize("chunk", [7, pytest.param(0, marks=pytest.mark.slow), pytest.param(1000, marks=pytest.mark.slow)])
def test_chunked_logprobs_match_full_logits(chunk):
    """Values and gradients of the chunked log-probs equal the [B, T, V] path within 1e-5."""
    model = Decoder(CFG, rngs=nnx.Rngs(1))
    graphdef, state = nnx.split(model)
    b = _batch()
    targets = b["tokens"][:, 1:]
    w = jnp.asarray(np.random.default_rng(2).normal(size=targets.shape), jnp.float32)

    def full(state):
        m = nnx.merge(graphdef, state)
        logits = m(b["tokens"], b["positions"], b["attn_mask"])[:, :-1]
        lp, ent = losses.token_logprobs(logits, targets, 0.7)
        return jnp.sum(lp * w), (lp, ent)

    def chunked(state):
        m = nnx.merge(graphdef, state)
        h = m.hidden(b["tokens"], b["positions"], b["attn_mask"])[:, :-1]
        lp, ent = losses.chunked_token_logprobs(h, targets, m.unembed, 0.7, chunk)
        return jnp.sum(lp * w), (lp, ent)

    (v0, (lp0, e0)), g0 = jax.value_and_grad(full, has_aux=True)(state)
    (v1, (lp1, e1)), g1 = jax.jit(jax.value_and_grad(chunked, has_aux=True))(state)
    np.testing.assert_allclose(np.asarray(lp1), np.asarray(lp0), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(e1), np.asarray(e0), atol=1e-5, rtol=0)
    assert float(jnp.max(jnp.abs(lp0))) > 1.0  # real values, not zeros
    for a, c in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(c), np.asarray(a), atol=1e-5, rtol=1e-4)


def test_num_micro_batches():
    assert num_micro_batches(32, 512, 1, 0) == 1  # no budget: one pass
    assert num_micro_batches(32, 512, 1, 32 * 512) == 1
    assert num_micro_batches(32, 512, 1, 8192) == 2  # 16 rows x 512 per pass
    assert num_micro_batches(32, 512, 4, 8192) == 1  # 8 rows per device already fit
    assert num_micro_batches(12, 100, 1, 500) == 3  # 4 rows (largest divisor of 12 <= 5)
    assert num_micro_batches(8, 4096, 1, 1000) == 8  # at least one row per pass


@pytest.mark.parametrize("loss_agg,memory", [
    ("token_mean", UpdateMemory(micro_batch_tokens=2 * 32, logit_chunk=16)),
    ("seq_mean_token_mean", UpdateMemory(micro_batch_tokens=4 * 32, logit_chunk=0, remat=True)),
    pytest.param("token_mean", UpdateMemory(micro_batch_tokens=0, logit_chunk=5, remat=True),
                 marks=pytest.mark.slow),
])
def test_micro_batched_update_equals_one_pass(loss_agg, memory):
    """Accumulating over micro-batches (with chunking / remat) gives the one-pass update."""
    # SGD: the parameter change is the gradient itself (Adam would rescale tiny differences).
    opt = optax.sgd(1.0)
    kw = dict(eps_low=0.2, eps_high=0.28, kl_coef=0.0, loss_agg=loss_agg, temperature=1.0)
    graphdef, state = nnx.split(Decoder(CFG, rngs=nnx.Rngs(3)))
    b = _batch(rows=8, seq=32, seed=5)
    assert num_micro_batches(8, 32, 1, memory.micro_batch_tokens) in (1, 2, 4)
    ref_state, _, m_ref = make_grpo_step(graphdef, opt, **kw)(
        jax.tree.map(jnp.copy, state), opt.init(state), b)
    got_state, _, m = make_grpo_step(graphdef, opt, memory=memory, **kw)(
        jax.tree.map(jnp.copy, state), opt.init(state), b)
    for k in ("loss", "grad_norm", "entropy", "clip_fraction", "pg_loss", "ratio_mean"):
        np.testing.assert_allclose(float(m[k]), float(m_ref[k]), atol=1e-5, rtol=1e-5, err_msg=k)
    assert float(m_ref["grad_norm"]) > 1e-3
    for a, c in zip(jax.tree.leaves(ref_state), jax.tree.leaves(got_state)):
        np.testing.assert_allclose(np.asarray(c), np.asarray(a), atol=2e-6, rtol=1e-5)
    moved = max(float(jnp.max(jnp.abs(a - s0))) for a, s0 in zip(jax.tree.leaves(ref_state), jax.tree.leaves(state)))
    assert moved > 1e-3  # the update did change the parameters
