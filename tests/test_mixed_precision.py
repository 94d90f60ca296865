"""Mixed precision and the learning-rate schedule (issue 30, item 4).

* float32 master weights under bf16 compute: a bf16 HF checkpoint loads as float32 parameters
  (widened exactly), the AdamW moments are float32, and one GRPO update at learning rate 1e-6
  moves the parameters by what float32 arithmetic predicts (Adam's first step: ~lr on every
  element with a gradient), where the same update on bf16 parameters leaves nearly every weight
  where it was (1e-6 is below half a bf16 spacing for any weight above ~5e-4). The rollout gets a
  bf16 copy; checkpoints keep float32 and old bf16 ones restore into float32.
* The schedule counts optimizer steps: ``grpo.steps x grpo.minibatches`` in all, warmup
  ``grpo.warmup_steps x grpo.minibatches`` (Micikevicius et al. 2018, arXiv 1710.03740, for the
  first; the second was a cosine run reaching 0 after 1 / minibatches of the run).

Tolerances: learning-rate schedule values are float32 (``rtol=1e-5`` = 168 U covers the few
roundings of warmup and cosine); ``rtol=0.02`` on the median update size is a statistical
bound, not rounding (Adam's first steps move each weight by about the learning rate).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rhyme_jax.config import load_config
from rhyme_jax.data import load_problems
from rhyme_jax.data.synthetic import corpus
from rhyme_jax.io.checkpoint import Checkpointer
from rhyme_jax.model.loader import load_hf_checkpoint
from rhyme_jax.model.tokenizer import train_demo_tokenizer
from rhyme_jax.parallel.reshard import put_global
from rhyme_jax.parallel.rules import param_shardings
from rhyme_jax.train import assembly, losses
from rhyme_jax.train.assembly import RolloutParts, build_learner, build_policy
from rhyme_jax.train.optim import PARAM_DTYPE, grpo_optimizer, grpo_schedule_steps
from rhyme_jax.train.policy import build_model, compute_params

from _hf_fixtures import TINY, save_hf_model

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tiny_test.yaml"
LR = 1e-6


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def param_state(model):
    return nnx.state(model, nnx.Param)


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    """A bf16 HF checkpoint (tiny qwen2, with the demo tokenizer beside it) and a run config that
    trains it with bf16 compute at learning rate 1e-6 (``configs/gsm8k_qwen2.5_1.5b.yaml``'s)."""
    import torch

    root = tmp_path_factory.mktemp("mixed")
    ckpt = root / "qwen2_bf16"
    save_hf_model("qwen2", root / "f32", tied=False).to(torch.bfloat16).save_pretrained(str(ckpt))
    base = load_config(CONFIG)
    train_demo_tokenizer(corpus(load_problems(base.data)[0]), base.data.tokenizer_vocab_size,
                         ckpt / "tokenizer.json")
    cfg = load_config(CONFIG, [f"model.path={ckpt}", "model.dtype=bfloat16", f"grpo.learning_rate={LR}",
                               f"run.runs_dir={root / 'runs'}", "grpo.max_grad_norm=1.0"])
    policy, state = build_policy(cfg, root / "runs" / "tiny")
    return cfg, policy, state, ckpt


def _batch(rows: int = 8, seq: int = 32, seed: int = 0) -> dict:
    """A GRPO batch over the tiny checkpoint's vocabulary, advantages mixed in sign."""
    rng = np.random.default_rng(seed)
    vocab = TINY["vocab_size"]
    prompts = [rng.integers(5, vocab, rng.integers(4, 9)).tolist() for _ in range(rows)]
    responses = [rng.integers(5, vocab, rng.integers(6, 20)).tolist() for _ in range(rows)]
    b = losses.sequence_batch(prompts, responses, pad_id=0, max_len=seq)
    b.pop("lengths")
    b["advantages"] = rng.normal(size=rows).astype(np.float32)
    b["old_logprobs"] = np.zeros((rows, seq - 1), np.float32)  # replaced by the policy's own (ratio 1)
    b.pop("prompt_lens")
    return b


def _on_policy(learner, state, batch: dict) -> dict:
    """``batch`` with ``old_logprobs`` = the policy's own log-probs (a sync on-policy step)."""
    sharded = put_global(batch, learner.layout.batch)
    return dict(sharded, old_logprobs=learner.ref_logprob_fn(state, sharded))


def _capture_grads() -> optax.GradientTransformation:
    """An 'optimizer' that leaves the params alone and returns the gradient as its state."""
    return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p),
                                        lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))


def test_bf16_checkpoint_loads_as_float32_master_weights(bf16_run):
    cfg, policy, state, ckpt = bf16_run
    assert {x.dtype for x in leaves(state)} == {np.dtype(np.float32)}
    _, model16 = load_hf_checkpoint(ckpt, dtype=jnp.bfloat16)  # inference load: bf16 params
    for a, b in zip(leaves(state), leaves(param_state(model16))):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(a, b.astype(np.float32))  # bf16 -> f32 widening is exact
    model = build_model(cfg, policy.tokenizer, 0)  # the SFT path: same master weights
    assert model.dtype == jnp.bfloat16
    assert all(x.dtype == np.float32 for x in leaves(param_state(model)))
    # The layers compute in bf16 from f32 params exactly as from a bf16 copy (what the rollout gets).
    tokens = jnp.asarray(np.arange(24).reshape(2, 12) % TINY["vocab_size"], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
    np.testing.assert_array_equal(np.asarray(model(tokens, pos)), np.asarray(model16(tokens, pos)))


def test_one_update_at_lr_1e6_moves_the_float32_weights(bf16_run, monkeypatch):
    """The real update (``build_learner``: bf16 compute, f32 params) equals an eager float32
    AdamW step on the same gradients; its first Adam step moves every weight with a gradient by
    ~lr; the same update over bf16 params (the old behaviour) leaves nearly all of them in place."""
    cfg, policy, state, _ = bf16_run
    learner, opt_state = build_learner(cfg, policy, state)
    assert all(x.dtype == np.float32 for x in leaves(opt_state) if np.issubdtype(x.dtype, np.floating))
    batch = _on_policy(learner, state, _batch())
    p0, o0 = jax.tree.map(jnp.copy, state), jax.tree.map(jnp.copy, opt_state)

    with monkeypatch.context() as m:  # the same jitted step with the gradient as "optimizer state"
        m.setattr(assembly, "grpo_optimizer", lambda g: _capture_grads())
        cap, cap_state = build_learner(cfg, policy, state)
    _, grads, metrics = cap.step_fn(jax.tree.map(jnp.copy, state), cap_state, batch)
    assert float(metrics["finite"]) == 1.0 and float(metrics["grad_norm"]) > 0
    updates, _ = learner.optimizer.update(grads, o0, p0)
    expected = optax.apply_updates(p0, updates)  # eager float32 AdamW step

    new, _, _ = learner.step_fn(jax.tree.map(jnp.copy, state), jax.tree.map(jnp.copy, opt_state), batch)
    before, after, want, g = leaves(p0), leaves(new), leaves(expected), leaves(grads)
    assert all(x.dtype == np.float32 for x in after)
    moved = has_grad = 0
    steps = []
    for b, a, w, gr in zip(before, after, want, g):
        assert np.all(np.abs(a - w) <= 2 * np.spacing(np.abs(b)) + 1e-12), "not the float32 AdamW step"
        live = np.abs(gr) > 1e-6  # Adam's first step is lr * g / (|g| + eps): ~lr where |g| >> eps
        has_grad += int(live.sum())
        moved += int((a != b)[live].sum())
        steps.append(np.abs(a - b)[live])
    steps = np.concatenate(steps)
    assert has_grad > 0.5 * sum(x.size for x in before)
    assert moved == has_grad  # every weight with a gradient moved
    np.testing.assert_allclose(np.median(steps), LR, rtol=0.02)
    assert steps.max() <= LR * 1.15  # the f32 rounding of p + lr near |p| ~ 1 (norm scales)

    # The old behaviour: bf16 params and moments, same config and batch.
    state16 = compute_params(state, jnp.bfloat16)
    learner16, opt16 = build_learner(cfg, policy, state16)
    new16, _, _ = learner16.step_fn(jax.tree.map(jnp.copy, state16), opt16, batch)
    total = sum(x.size for x in before)
    moved16 = sum(int((np.asarray(a) != np.asarray(b)).sum()) for a, b in zip(leaves(new16), leaves(state16)))
    assert moved16 < 0.05 * total, moved16 / total
    print(f"\nlr {LR}: float32 master weights moved {moved}/{total} elements (all {has_grad} with |g| > 1e-6; "
          f"median step {np.median(steps):.4g}); bf16 weights moved {moved16}/{total} ({moved16 / total:.2%})")


def test_rollout_gets_a_compute_dtype_copy(bf16_run):
    cfg, policy, state, _ = bf16_run
    parts = RolloutParts(engines=[], shardings=[param_shardings(state, policy.mesh)], scheduler=None,
                         history=None, drafter=None, dtype=jnp.bfloat16)
    (synced,) = parts.states(state)
    for a, b in zip(leaves(synced), leaves(state)):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(a, b.astype(jnp.bfloat16))
    assert all(x.dtype == np.float32 for x in leaves(state))  # the master weights are untouched
    kept = RolloutParts([], [param_shardings(state, policy.mesh)], None, None, None, dtype=jnp.float32)
    assert all(a is b for a, b in zip(jax.tree.leaves(compute_params(state, jnp.float32)), jax.tree.leaves(state)))
    assert all(x.dtype == np.float32 for x in leaves(kept.states(state)[0]))


def test_checkpoints_keep_float32_and_old_bf16_ones_restore(bf16_run, tmp_path):
    cfg, policy, state, _ = bf16_run
    learner, opt_state = build_learner(cfg, policy, state)
    with Checkpointer(tmp_path / "f32") as c:
        c.save(1, params=state, opt_state=opt_state, meta={"step": 1})
        params, opt, _ = c.restore(None, params_like=state, opt_state_like=opt_state)
    for a, b in zip(leaves(params) + leaves(opt), leaves(state) + leaves(opt_state)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    # A run checkpointed before the master weights were float32 (bf16 params and moments).
    state16 = compute_params(state, jnp.bfloat16)
    opt16 = build_learner(cfg, policy, state16)[1]
    with Checkpointer(tmp_path / "bf16") as c:
        c.save(1, params=state16, opt_state=opt16, meta={"step": 1})
        params, opt, _ = c.restore(None, params_like=state, opt_state_like=opt_state)
    for a, b in zip(leaves(params), leaves(state16)):
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, b.astype(np.float32))
    assert all(x.dtype == y.dtype for x, y in zip(leaves(opt), leaves(opt_state)))


# ------------------------------------------------------------------ the schedule
def _rates(optimizer: optax.GradientTransformation, n: int) -> np.ndarray:
    """The learning rate of each of ``n`` updates, read off the real optimizer: with a constant
    gradient 1 (no clipping, no decay) Adam's normalised step m_hat / (sqrt(v_hat) + eps) is
    1 / (1 + 1e-8), so update k is -rate_k."""
    params = {"w": jnp.zeros((), PARAM_DTYPE)}
    grads = {"w": jnp.ones((), PARAM_DTYPE)}
    state, out = optimizer.init(params), []
    for _ in range(n):
        upd, state = optimizer.update(grads, state, params)
        out.append(-float(upd["w"]) * (1 + 1e-8))
    return np.asarray(out)


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_schedule_counts_optimizer_steps(schedule):
    """steps=10 x minibatches=4: 40 optimizer steps; warmup_steps=2 GRPO steps = 8 updates."""
    cfg = load_config(CONFIG, ["grpo.steps=10", "grpo.minibatches=4", "grpo.warmup_steps=2",
                               f"grpo.schedule={schedule}", "grpo.learning_rate=1e-3"])
    assert grpo_schedule_steps(cfg.grpo) == (40, 8)
    rates = _rates(grpo_optimizer(cfg.grpo), 41)
    peak = 1e-3
    # Warmup: linear from 0 over the first 2 GRPO steps (8 updates); the peak at the first update
    # of GRPO step 3, never before.
    np.testing.assert_allclose(rates[:9], peak * np.arange(9) / 8, rtol=1e-5, atol=1e-12)
    assert rates[:8].max() < peak
    if schedule == "constant":
        np.testing.assert_allclose(rates[8:], peak, rtol=1e-5)
        return
    # Cosine: decreasing over the 40 updates of the run, the end value (0) reached at count 40
    # (when the run ends) and not before: update 39, the last, still runs above it.
    assert np.all(np.diff(rates[8:40]) < 0)
    assert rates[39] > 0 and rates[39] < 0.01 * peak
    assert rates[40] == pytest.approx(0.0, abs=1e-12)
    # Counted in GRPO steps (the bug), the rate was 0 from update 10 on: now it is still near the peak.
    assert rates[10] > 0.99 * peak and rates[20] > 0.4 * peak


def test_memory_planner_counts_float32_master_weights():
    """``rhyme-jax memory``: params + AdamW in float32 whatever model.dtype; the rollout copy in
    model.dtype; the compiled update takes float32 params."""
    from rhyme_jax.train.memory_plan import memory_report

    cfg = load_config(CONFIG, ["model.dtype=bfloat16"])
    r = memory_report(cfg, devices=1, rows=2, tokens=32)
    n = r["params"]
    assert r["param_dtype"] == "float32" and r["dtype"] == "bfloat16"
    assert r["param_bytes_total"] == 4 * n and r["opt_bytes_total"] >= 8 * n
    assert r["rollout_param_bytes_per_device"] == 2 * n
    assert r["param_dtype"] == "float32" and r["update_argument_bytes"] >= 12 * n  # params + 2 moments in f32
