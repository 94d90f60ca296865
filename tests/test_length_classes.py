"""Packing by length classes (``grpo.pack_lengths``, ``train/length_classes.py``) and the update
that accumulates its calls (``train/accumulate.py``): the same loss and gradient as the padded step.

Tolerances are ``tests/test_packing.py``'s (the same layouts' float32 bounds): the calls hold the
same segments at other offsets, and the accumulation adds a handful of per-call float32 sums,
whose rounding ``f32.dot`` bounds over the number of calls.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import f32
from rhyme_jax.config import ConfigError, load_config
from rhyme_jax.model.transformer import Decoder
from rhyme_jax.train import losses
from rhyme_jax.train.accumulate import make_accumulating_step
from rhyme_jax.train.grpo_step import _target_logprobs, make_grpo_step
from rhyme_jax.train.length_classes import call_rows, pack_by_length, place_in_classes
from test_packing import CFG, _long_tail_batch

CLASSES = [16, 32, 64]


def test_rows_go_to_the_smallest_class_and_fill_open_buffers():
    # longest first: 60 opens a 64-buffer (room 4), 20 a 32 (room 12), 14 a 16 (fits neither);
    # 9 goes into the 32 (room 3), 3 into the 64 (room 1), 2 into the 32; the empty row is left out
    got = place_in_classes(np.array([3, 60, 9, 0, 20, 14, 2]), CLASSES)
    assert got == [(64, [1, 0]), (32, [4, 2, 6]), (16, [5])]
    with pytest.raises(ValueError, match="exceeds the largest of grpo.pack_lengths"):
        place_in_classes(np.array([65]), CLASSES)
    assert call_rows(9, 4, 1) == [4, 4, 1]
    assert call_rows(7, 8, 2) == [8]  # the rest rounded up to 2 x a power of two, at most a full call
    assert call_rows(5, 8, 1) == [8] and call_rows(3, 8, 1) == [4] and call_rows(0, 8, 1) == []


def test_pack_by_length_moves_every_token_and_weight():
    b = _long_tail_batch()
    calls = pack_by_length(b, "seq_mean_token_mean", CLASSES, call_tokens=64)
    assert {c["tokens"].shape[1] for c in calls} <= set(CLASSES) and len(calls) > 1
    for c in calls:
        assert c["tokens"].shape[0] * c["tokens"].shape[1] <= 64 or c["tokens"].shape[0] == 1
    total = lambda k: sum(float(c[k].sum()) for c in calls)
    carries = b["loss_mask"].sum(axis=1) > 0  # a row without loss tokens stays out
    assert total("attn_mask") == b["attn_mask"][carries].sum() and total("loss_mask") == b["loss_mask"].sum()
    w = losses.loss_weights(b["loss_mask"][:, :-1], "seq_mean_token_mean")[0]
    assert total("loss_w") == pytest.approx(float(np.sum(w)), rel=1e-6)
    # the long row sits in a 64-buffer; nothing short is padded to 64 unless it shares that buffer
    lengths = b["attn_mask"].sum(1)
    assert sum(c["tokens"].shape[0] for c in calls if c["tokens"].shape[1] == 64) == 1 and lengths.max() > 32


def test_accumulated_step_equals_the_padded_step():
    """One update over the class calls against ``make_grpo_step`` on the padded minibatch: with
    plain SGD at rate 1 the parameter change is the gradient, so the two changes compare as the
    packed and padded gradients do (``tests/test_packing.py``). Two rows of advantage 0 (a group
    whose rewards are all equal) stay out of the calls (``grpo.skip_zero_advantage_rows``), and
    the gradient is still the padded update's over every row."""
    loss_agg = "seq_mean_token_mean"
    graphdef, state = nnx.split(Decoder(CFG, rngs=nnx.Rngs(4)))
    b = _long_tail_batch(rows=16)
    zero = np.flatnonzero(b["loss_mask"].sum(axis=1) > 0)[[1, 3]]
    b["advantages"][zero] = 0.0
    calls = pack_by_length(b, loss_agg, CLASSES[1:], call_tokens=64, skip_zero_advantage=True)
    assert len({c["tokens"].shape for c in calls}) >= 2  # two classes: fewer programs to compile
    kept = (b["loss_mask"].sum(axis=1) > 0) & (b["advantages"] != 0)
    assert sum(int(c["attn_mask"].sum()) for c in calls) == b["attn_mask"][kept].sum() < b["attn_mask"].sum()
    assert sum(float(c["token_w"].sum()) for c in calls) == pytest.approx(1.0, rel=1e-6)  # metrics: rows kept
    kw = dict(eps_low=0.2, eps_high=0.28, kl_coef=0.0, loss_agg=loss_agg, temperature=1.0)
    opt = optax.sgd(1.0)
    copy = lambda s: jax.tree.map(jnp.copy, s)
    padded = make_grpo_step(graphdef, opt, **kw)
    s0, _, m0 = padded(copy(state), opt.init(state), {k: jnp.asarray(v) for k, v in b.items()})
    step = make_accumulating_step(graphdef, opt, **kw)
    s1, _, m1 = step(copy(state), opt.init(state), [{k: jnp.asarray(v) for k, v in c.items()} for c in calls])
    assert float(m0["finite"]) == float(m1["finite"]) == 1.0

    T = b["tokens"].shape[1]
    lp0, _ = _target_logprobs(graphdef, state, {k: jnp.asarray(v) for k, v in b.items()}, 1.0)
    logits = nnx.merge(graphdef, state)(jnp.asarray(b["tokens"]), jnp.asarray(b["positions"]),
                                        jnp.asarray(b["attn_mask"]))
    bound = f32.logprobs(CFG, T, float(jnp.max(jnp.abs(logits))))
    sel0 = b["loss_mask"][:, :-1] > 0
    ratio_max = float(np.exp(np.max(np.asarray(lp0)[sel0] - b["old_logprobs"][sel0])))
    w0 = np.asarray(losses.loss_weights(b["loss_mask"][:, :-1], loss_agg)[0])
    loss_bound = float(np.sum(np.abs(w0 * b["advantages"][:, None]))) * ratio_max * 1.28 * math.expm1(bound)
    loss0, loss1 = float(m0["loss"]), float(m1["loss"])
    assert abs(loss0) > 1e-3
    assert abs(loss1 - loss0) <= loss_bound + f32.dot(int(sel0.sum()) + len(calls), abs(loss0))

    widths = f32.decoder_widths(CFG.num_layers, CFG.hidden_size, CFG.intermediate_size, CFG.num_heads,
                                CFG.head_dim, T)
    rel = f32.between_programs(2 * f32.forward(widths, 1.0)) + f32.gamma(len(calls))
    flat = lambda s: np.concatenate([np.ravel(x) for x in jax.tree.leaves(s)])  # noqa: E731
    d0, d1 = flat(s0) - flat(state), flat(s1) - flat(state)
    d, n = np.linalg.norm(d1 - d0), np.linalg.norm(d0)
    assert n > 1e-3 and d <= rel * n, (d / n, rel)
    assert float(m1["grad_norm"]) == pytest.approx(float(m0["grad_norm"]), rel=rel)


def test_pack_lengths_config_checks(tmp_path):
    bad = {"grpo.pack_lengths=[256,512]": "needs grpo.padding_free=true",
           "grpo.padding_free=true grpo.pack_lengths=[512,256]": "strictly increasing",
           "grpo.padding_free=true grpo.pack_lengths=[100]": "multiples of 16",
           "grpo.padding_free=true grpo.pack_lengths=[16]": "the largest must be >= rollout.max_prompt_len"}
    bad["grpo.skip_zero_advantage_rows=true"] = "needs grpo.padding_free=true"
    bad["grpo.padding_free=true grpo.skip_zero_advantage_rows=true grpo.kl_coef=0.01"] = "needs grpo.kl_coef=0"
    bad["grpo.padding_free=true grpo.skip_zero_advantage_rows=true grpo.entropy_coef=0.01"] = "needs grpo.entropy_coef=0"
    for sets, msg in bad.items():
        with pytest.raises(ConfigError, match=msg):
            load_config("configs/default.yaml", sets.split())
    cfg = load_config("configs/longtail.yaml")
    assert cfg.grpo.pack_lengths[-1] >= cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens


def test_memory_plan_takes_the_largest_class_call():
    """``rhyme-jax memory`` with ``grpo.pack_lengths`` plans one call of the largest buffer
    length: ``micro_batch_tokens // length`` rows (the call with the most attention)."""
    from rhyme_jax.train.memory_plan import memory_report

    cfg = load_config("configs/tiny_test.yaml", ["rollout.max_prompt_len=32", "rollout.max_new_tokens=16",
                                                 "grpo.padding_free=true", "grpo.pack_lengths=[32,48]",
                                                 "grpo.micro_batch_tokens=96"])
    r = memory_report(cfg, devices=1)
    assert (r["rows"], r["tokens"], r["pack_lengths_call"]) == (2, 48, True) and r["update_temp_bytes"] > 0


def test_memory_plan_compiles_the_runs_attention_and_unroll():
    """The plan compiles the update the run compiles: the config's layer unroll and attention op
    on the packed batch. Dense attention holds [H, T, T] scores; block-sparse attention (``model.attention_block``) holds O(T x block)."""
    from rhyme_jax.train.memory_plan import memory_report

    base = ["rollout.max_prompt_len=256", "rollout.max_new_tokens=256", "grpo.padding_free=true",
            "grpo.micro_batch_tokens=512", "model.tiny.num_layers=2", "model.tiny.num_heads=4",
            "model.tiny.num_kv_heads=2"]
    temp = {name: memory_report(load_config("configs/tiny_test.yaml", base + sets), devices=1)["update_temp_bytes"]
            for name, sets in {"dense": ["model.scan_unroll=1"], "unrolled": ["model.scan_unroll=2"],
                               "blocked": ["model.scan_unroll=2", "model.attention_block=128"]}.items()}
    scores = 4 * 512 * 512 * 4  # one f32 [H, T, T]
    assert temp["unrolled"] != temp["dense"]  # the unroll reaches the compiled program
    assert temp["dense"] >= scores and temp["blocked"] < min(temp["dense"], temp["unrolled"]) / 2
