"""The padding-free update (``train/packing.py``, ``grpo.padding_free``): packed equals padded.

Tolerances: the packed and padded programs compute every token's logprob from the same weights
and the same context but lay the tokens at other offsets of other rows, so their reductions run
in other orders: per token the two logprobs differ by at most ``f32.logprobs`` (two programs'
float32 forward bounds, derived in tests/f32.py). The loss is a weighted sum of per-token terms
``-min(r A, clip(r) A)`` with ``r = exp(lp - old)``: it moves by at most ``sum |w A| r_max`` times
``expm1(dlp)``. The gradient is the backward pass of the same network, a path of the same
reductions run in reverse, so its normwise relative error is within twice the forward bound of
that path (each direction once), doubled for two programs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import f32
from rhyme_jax.model.config import ModelConfig
from rhyme_jax.model.transformer import Decoder
from rhyme_jax.train import losses
from rhyme_jax.train.grpo_step import _target_logprobs, make_grads_fn
from rhyme_jax.train.packing import first_fit_decreasing, pack_minibatch, packed_rows

CFG = ModelConfig(family="qwen2", vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=False)


def _long_tail_batch(rows=8, seq=64, seed=0):
    """A minibatch with one long row and many short ones (the case packing is for), plus one
    padding row (all-False ``attn_mask``), as ``trainer._update`` builds it."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, 97, rng.integers(3, 8)).tolist() for _ in range(rows - 1)]
    lens = [50] + rng.integers(0, 12, rows - 2).tolist()
    responses = [rng.integers(2, 97, n).tolist() for n in lens]
    b = losses.sequence_batch(prompts, responses, pad_id=0, max_len=seq)
    lps = [(-rng.random(len(r)) * 3).tolist() for r in responses]
    b["old_logprobs"] = losses.response_grid(lps, b.pop("prompt_lens"), b["tokens"].shape[1])
    b.pop("lengths")
    b["advantages"] = rng.normal(size=rows - 1).astype(np.float32)
    norm = losses.loss_normaliser("seq_mean_token_sum_norm", response_tokens=sum(lens), rows=rows - 1, minibatches=1,
                                  max_new_tokens=64)
    b["loss_norm"] = np.full(rows - 1, norm, np.float32)
    return {k: np.concatenate([v, np.zeros((1,) + v.shape[1:], v.dtype)]) for k, v in b.items()}


def test_first_fit_decreasing_and_row_buckets():
    assert first_fit_decreasing(np.array([5, 9, 0, 3, 4, 2]), 10) == [[1], [0, 4], [3, 5]]
    with pytest.raises(ValueError, match="exceeds the buffer of 8"):
        first_fit_decreasing(np.array([9]), 8)
    assert [packed_rows(b, 2, 16) for b in (1, 2, 3, 5, 9, 16)] == [2, 2, 4, 6, 10, 16]
    assert [packed_rows(b, 1, 128) for b in (1, 17, 100)] == [16, 32, 112]
    assert packed_rows(7, 4, 6) == 7  # never fewer buffers than bins


def test_pack_moves_every_token_with_its_values():
    b = _long_tail_batch()
    b["is_weights"] = np.random.default_rng(3).uniform(0.5, 2.0, b["old_logprobs"].shape).astype(np.float32)  # grpo.tis
    p = pack_minibatch(b, "token_mean")
    assert p["tokens"].shape[0] < b["tokens"].shape[0]  # fewer buffers than padded rows
    carries = b["loss_mask"].sum(axis=1) > 0  # a row without loss tokens (empty response) stays out
    assert 0 < b["attn_mask"][~carries].sum() and p["attn_mask"].sum() == b["attn_mask"][carries].sum()
    assert p["loss_mask"].sum() == b["loss_mask"].sum()
    # each segment is its padded row: tokens, positions from 0, its advantage on its targets
    for r in np.flatnonzero(carries):
        n = int(b["attn_mask"][r].sum())
        hits = [(i, j) for i in range(p["tokens"].shape[0]) for j in range(p["tokens"].shape[1] - n + 1)
                if p["positions"][i, j] == 0 and p["attn_mask"][i, j]
                and np.array_equal(p["tokens"][i, j:j + n], b["tokens"][r, :n])]
        i, j = hits[0]
        np.testing.assert_array_equal(p["positions"][i, j:j + n], np.arange(n))
        assert len(set(p["segment_ids"][i, j:j + n])) == 1
        np.testing.assert_array_equal(p["old_logprobs"][i, j:j + n - 1], b["old_logprobs"][r, :n - 1])
        np.testing.assert_array_equal(p["is_weights"][i, j:j + n - 1], b["is_weights"][r, :n - 1])
        assert np.all(p["advantages"][i, j:j + n - 1] == b["advantages"][r])


@pytest.mark.parametrize("loss_agg", [
    # the aggregation that needs each sequence's own token count; slow for CI time: the default set's
    # tests/test_length_classes.py compares the packed update (the same first_fit, target grid and
    # buffers, in two lengths) with the padded one under this aggregation
    pytest.param("seq_mean_token_mean", marks=pytest.mark.slow),
    pytest.param("token_mean", marks=pytest.mark.slow),
    pytest.param("seq_mean_token_sum_norm", marks=pytest.mark.slow),
])
def test_packed_loss_and_gradients_equal_padded(loss_agg):
    graphdef, state = nnx.split(Decoder(CFG, rngs=nnx.Rngs(4)))
    b = _long_tail_batch()
    p = pack_minibatch(b, loss_agg)
    T = b["tokens"].shape[1]
    kw = dict(eps_low=0.2, eps_high=0.28, kl_coef=0.0, loss_agg=loss_agg, temperature=1.0)
    grads = jax.jit(make_grads_fn(graphdef, **kw))
    (loss0, m0), g0 = grads(state, {k: jnp.asarray(v) for k, v in b.items()})
    (loss1, m1), g1 = grads(state, {k: jnp.asarray(v) for k, v in p.items()})

    # per-token logprobs of the two layouts, matched through the moved old_logprobs grid
    lp0, _ = _target_logprobs(graphdef, state, {k: jnp.asarray(v) for k, v in b.items()}, 1.0)
    lp1, _ = _target_logprobs(graphdef, state, {k: jnp.asarray(v) for k, v in p.items()}, 1.0)
    logits = nnx.merge(graphdef, state)(jnp.asarray(b["tokens"]), jnp.asarray(b["positions"]),
                                        jnp.asarray(b["attn_mask"]))
    bound = f32.logprobs(CFG, T, float(jnp.max(jnp.abs(logits))))
    sel0, sel1 = b["loss_mask"][:, :-1] > 0, p["loss_mask"][:, :-1] > 0
    a, c = np.asarray(lp0)[sel0], np.asarray(lp1)[sel1]
    np.testing.assert_array_equal(np.sort(b["old_logprobs"][:, :][sel0]), np.sort(p["old_logprobs"][sel1]))
    assert np.max(np.abs(np.sort(a) - np.sort(c))) <= bound

    ratio_max = float(np.exp(np.max(np.asarray(lp0)[sel0] - b["old_logprobs"][sel0])))
    w0 = np.asarray(losses.loss_weights(b["loss_mask"][:, :-1], loss_agg, float(np.max(b["loss_norm"])))[0])
    loss_bound = float(np.sum(np.abs(w0 * b["advantages"][:, None]))) * ratio_max * 1.28 * math.expm1(bound)
    assert abs(float(loss1) - float(loss0)) <= loss_bound + f32.dot(int(sel0.sum()), abs(float(loss0)))
    assert abs(float(loss0)) > 1e-3

    widths = f32.decoder_widths(CFG.num_layers, CFG.hidden_size, CFG.intermediate_size, CFG.num_heads,
                                CFG.head_dim, T)
    rel = f32.between_programs(2 * f32.forward(widths, 1.0))
    flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
    d, n = np.linalg.norm(flat(g1) - flat(g0)), np.linalg.norm(flat(g0))
    assert n > 1e-3 and d <= rel * n, (d / n, rel)


@pytest.mark.slow  # two compiles of the update (~14 s on 2 cores); test_losses checks the segment means
def test_packed_sequence_level_ratio_equals_padded():
    """GSPO (``grpo.importance_sampling_level=sequence``) under ``grpo.padding_free``: the ratio is
    each segment's, not each packed row's, so the packed loss and gradients equal the padded ones.

    Tolerance: each sequence's log-ratio is a mean of per-token log-ratios, each within
    ``f32.logprobs`` of the other layout's, plus the two programs' rounding of that mean (a sum of
    at most T terms in another order: ``2 gamma(T) max |log-ratio|``); the sequence ratio, which
    is at most the largest token ratio, moves by ``expm1`` of that. The gradient's bound is
    ``test_packed_loss_and_gradients_equal_padded``'s, plus the same relative move of the ratio
    that scales each sequence's upstream gradient."""
    graphdef, state = nnx.split(Decoder(CFG, rngs=nnx.Rngs(4)))
    b = _long_tail_batch(seed=1)
    p = pack_minibatch(b, "seq_mean_token_mean")
    assert p["tokens"].shape[0] < b["tokens"].shape[0] and p["segment_ids"].max() > 1  # rows hold several
    T = b["tokens"].shape[1]
    kw = dict(eps_low=0.2, eps_high=0.28, kl_coef=0.0, loss_agg="seq_mean_token_mean", temperature=1.0,
              importance_sampling_level="sequence")
    grads = jax.jit(make_grads_fn(graphdef, **kw))
    (loss0, m0), g0 = grads(state, {k: jnp.asarray(v) for k, v in b.items()})
    (loss1, m1), g1 = grads(state, {k: jnp.asarray(v) for k, v in p.items()})

    lp0, _ = _target_logprobs(graphdef, state, {k: jnp.asarray(v) for k, v in b.items()}, 1.0)
    logits = nnx.merge(graphdef, state)(jnp.asarray(b["tokens"]), jnp.asarray(b["positions"]),
                                        jnp.asarray(b["attn_mask"]))
    sel0 = b["loss_mask"][:, :-1] > 0
    log_ratio = np.asarray(lp0)[sel0] - b["old_logprobs"][sel0]
    dlog = f32.logprobs(CFG, T, float(jnp.max(jnp.abs(logits)))) + 2 * f32.gamma(T) * float(np.max(np.abs(log_ratio)))
    ratio_max = float(np.exp(np.max(log_ratio)))
    w0 = np.asarray(losses.loss_weights(b["loss_mask"][:, :-1], "seq_mean_token_mean")[0])
    loss_bound = float(np.sum(np.abs(w0 * b["advantages"][:, None]))) * ratio_max * 1.28 * math.expm1(dlog)
    assert abs(float(loss1) - float(loss0)) <= loss_bound + f32.dot(int(sel0.sum()), abs(float(loss0)))
    assert abs(float(loss0)) > 1e-3
    # the padded layout's sequence ratio is the row's: it is what the packed one must reproduce
    row_mean = (np.asarray(lp0) - b["old_logprobs"]) * sel0
    want_ratio = np.exp(row_mean.sum(1) / np.maximum(sel0.sum(1), 1))
    want = (want_ratio[:, None] * sel0).sum() / sel0.sum()
    assert abs(float(m1["ratio_mean"]) - want) <= want * math.expm1(dlog) + f32.dot(int(sel0.sum()), want)

    widths = f32.decoder_widths(CFG.num_layers, CFG.hidden_size, CFG.intermediate_size, CFG.num_heads,
                                CFG.head_dim, T)
    rel = f32.between_programs(2 * f32.forward(widths, 1.0)) + math.expm1(dlog)
    flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])  # noqa: E731
    d, n = np.linalg.norm(flat(g1) - flat(g0)), np.linalg.norm(flat(g0))
    assert n > 1e-3 and d <= rel * n, (d / n, rel)
