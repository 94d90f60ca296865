"""Loss and gradient parity with TRL's ``GRPOTrainer`` (trl 1.x), docs/trl_mapping.md.

One GRPO step's generation batch (4 prompts x 3 samples, equal-length prompts, right-padded
completions ending in EOS, one cut at ``max_completion_length``) goes through both trainers:

* TRL: a ``GRPOTrainer`` on a tiny random Llama saved with ``save_pretrained`` (float32, eager
  attention; the reference loaded by TRL from that directory, the policy then moved away from
  it), completions handed in through ``rollout_func`` and rewards through a reward function, so
  ``_generate_and_score_completions`` computes the advantages, ``num_items_in_batch``, the
  current logprobs and the reference logprobs itself. The behaviour (old) logprobs are the
  current ones plus noise, so ratios sit away from 1 and clip on both sides. The first of
  ``steps_per_generation = 2`` slices is scored with ``_compute_loss`` and back-propagated.
* ours: the same checkpoints through ``model.loader.load_hf_checkpoint``, advantages from
  ``losses.group_advantages``, the batch laid out as ``trainer._update`` lays it out
  (``sequence_batch``, ``response_grid``, ``loss_normaliser``; ``grpo.minibatches = 2``) and the
  first minibatch's loss and gradient from ``grpo_step``: ``make_grads_fn`` (what the jitted
  update differentiates) or its two halves ``minibatch_loss_weights`` + ``make_weighted_grads_fn``
  (one compile for every aggregation).

Asserted: advantages, current and reference logprobs; the loss within 1e-5 relative; every
parameter's gradient within 1e-4 relative (``max |ours - TRL| / max |TRL|`` per tensor, HF
tensors mapped to ours with ``loader.key_map``: layer stacking and the Linear transpose).

Tolerances (tests/f32.py): TRL computes in torch and rhyme-jax in XLA, two float32 programs
over the same weights and tokens, so every comparison is ``f32.between_programs`` of one
program's bound. Logprobs of the tiny Llama (2 layers, width <= 64, |logit| < 5): ``f32.logprobs``
is below 2e-5 (``logprob_atol``). The loss is a token aggregate of at most 36 terms of O(1):
``gamma(36) + short(8, 1)`` = 52 U relative per program on sums of one sign, ~2e-6 for two
(``LOSS_RTOL = 1e-5`` leaves room for the advantage-weighted cancellation). Gradients run the
same reductions backwards through the same depth: normwise relative error within twice the
forward bound of that path (``f32.forward`` of the model's widths, ~3e-5 here), so
``GRAD_RTOL = 1e-4``; advantages are a few operations per value (``rtol=1e-5``, ``atol=1e-6`` for
zero-mean groups). Measured: loss within 2.1e-6, gradients within 1.2e-6 over 45 cases. A wrong
aggregation, clip or KL term moves them by percent.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

trl = pytest.importorskip("trl", reason="TRL parity tests need trl 1.x (the `test` extra: pip install -e '.[test]')")
torch = pytest.importorskip("torch", reason="TRL parity tests need torch (the `test` extra)")

from _hf_fixtures import make_hf_model  # noqa: E402
from rhyme_jax.model.loader import key_map, load_hf_checkpoint  # noqa: E402
from rhyme_jax.train import grpo_step, losses  # noqa: E402
from rhyme_jax.train.overlong import mask_rows  # noqa: E402

# TRL loss_type -> our grpo.loss_agg (docs/trl_mapping.md)
LOSS_TYPES = {"grpo": "seq_mean_token_mean", "bnpo": "token_mean", "dr_grpo": "seq_mean_token_sum_norm",
              "dapo": "step_token_mean"}
GROUPS, N, MINIBATCHES = 4, 3, 2
ROWS = GROUPS * N
PROMPT_LEN, MAX_NEW = 5, 8
TEMPERATURE, EPS_LOW, EPS_HIGH, BETA = 0.7, 0.2, 0.28, 0.04
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
MEASURED: dict[str, tuple[float, float]] = {}  # case -> (loss rel. error, worst gradient rel. error)


class Setup(NamedTuple):
    """A model on both sides: TRL loads ``ref_dir`` (its reference, and its policy before
    ``policy_sd`` is loaded into it); rhyme-jax loads ``policy_dir`` and ``ref_dir``."""

    ref_dir: Path
    policy_dir: Path
    policy_sd: dict | None  # torch state dict of the policy; None = the policy is ref_dir's model
    tokenizer: object
    vocab: int
    eos: int
    pad: int


def _rollout_data(setup: Setup, seed: int = 0):
    """Prompts (one per group, repeated n times), completions (EOS-terminated, one cut at
    MAX_NEW) and rewards (mixed within groups; group 2 constant: advantage 0)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(4, setup.vocab, PROMPT_LEN).tolist() for _ in range(GROUPS)]
    lens = rng.integers(2, MAX_NEW, ROWS)
    completions = [rng.integers(4, setup.vocab, n - 1).tolist() + [setup.eos] for n in lens]
    completions[4] = rng.integers(4, setup.vocab, MAX_NEW).tolist()  # truncated: no EOS
    rewards = np.array([1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.25, 1.0], np.float32)
    return [p for p in prompts for _ in range(N)], completions, rewards


def _word_tokenizer(vocab: int, eos: int, pad: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=f"t{eos}", pad_token=f"t{pad}", unk_token="t1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Setup:
    """A tiny random Llama (the reference) and a copy moved away from it (every tensor + 0.1 std
    of noise: the policy)."""
    root = tmp_path_factory.mktemp("trl_parity")
    ref = make_hf_model("llama", tied=False, seed=0)
    ref.save_pretrained(str(root / "ref"), safe_serialization=True)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * p.std() * torch.randn_like(p))
    ref.save_pretrained(str(root / "policy"), safe_serialization=True)
    vocab = ref.config.vocab_size
    return Setup(root / "ref", root / "policy", {k: v.clone() for k, v in ref.state_dict().items()},
                 _word_tokenizer(vocab, 2, 0), vocab, 2, 0)


@functools.lru_cache(maxsize=4)
def _ours(policy_dir: Path, ref_dir: Path):
    """(cfg, graphdef, policy state, reference state) loaded with rhyme-jax's loader (float32)."""
    from flax import nnx

    cfg, policy = load_hf_checkpoint(policy_dir, dtype=jnp.float32)
    graphdef, state = nnx.split(policy)
    ref_state = state if ref_dir == policy_dir else nnx.split(load_hf_checkpoint(ref_dir, dtype=jnp.float32)[1])[1]
    return cfg, graphdef, state, ref_state


@functools.lru_cache(maxsize=None)
def _weighted_grads_fn(graphdef, kl_coef: float, kl_ratio_weighted: bool, is_level: str = "token",
                       entropy_coef: float = 0.0):
    """The update's gradient under given loss weights (one compile serves every aggregation)."""
    return jax.jit(grpo_step.make_weighted_grads_fn(graphdef, eps_low=EPS_LOW, eps_high=EPS_HIGH, kl_coef=kl_coef,
                                                    temperature=TEMPERATURE, kl_ratio_weighted=kl_ratio_weighted,
                                                    importance_sampling_level=is_level, entropy_coef=entropy_coef))


@functools.lru_cache(maxsize=None)
def _logprob_fn(graphdef):
    return grpo_step.make_logprob_fn(graphdef, TEMPERATURE)


def _our_grads(graphdef, state, first, loss_agg, beta, bias_correction, micro_batch_tokens=0, is_level="token",
               entropy_coef=0.0):
    """Our minibatch loss and gradient: ``make_grads_fn`` (weights and gradient in one jitted
    program, micro-batched) or, to share one compile over the aggregations, its two halves
    ``minibatch_loss_weights`` + ``make_weighted_grads_fn``."""
    if micro_batch_tokens:
        memory = grpo_step.UpdateMemory(micro_batch_tokens=micro_batch_tokens)
        fn = grpo_step.make_grads_fn(graphdef, eps_low=EPS_LOW, eps_high=EPS_HIGH, kl_coef=beta, loss_agg=loss_agg,
                                     temperature=TEMPERATURE, memory=memory, kl_ratio_weighted=bias_correction,
                                     importance_sampling_level=is_level, entropy_coef=entropy_coef)
        return jax.jit(fn)(state, first)
    weights = grpo_step.minibatch_loss_weights(first, loss_agg)
    return _weighted_grads_fn(graphdef, beta, bias_correction, is_level, entropy_coef)(state, first, *weights)


def _trl_trainer(setup: Setup, tmp_path, monkeypatch, loss_type, scale_rewards, beta, bias_correction,
                 is_level="token", entropy_coef=0.0, reward_funcs=None, reward_weights=None, mask_truncated=False):
    """A GRPOTrainer whose rollout is the fixed batch (``rollout_func``) and whose reward function
    returns the fixed rewards; the policy moved to ``setup.policy_sd``, the reference left at the
    checkpoint TRL loaded it from."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    prompts, completions, rewards = _rollout_data(setup)

    def rollout(texts, trainer):
        assert len(texts) == ROWS
        return {"prompt_ids": prompts, "completion_ids": completions, "logprobs": None}

    def fixed_reward(prompts, completions, row, **kwargs):
        return [float(rewards[i]) for i in row]

    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=ROWS // MINIBATCHES, steps_per_generation=MINIBATCHES,
        gradient_accumulation_steps=1, num_generations=N, max_completion_length=MAX_NEW, temperature=TEMPERATURE,
        beta=beta, epsilon=EPS_LOW, epsilon_high=EPS_HIGH, loss_type=loss_type, scale_rewards=scale_rewards,
        use_bias_correction_kl=bias_correction, importance_sampling_level=is_level, entropy_coef=entropy_coef,
        reward_weights=reward_weights, mask_truncated_completions=mask_truncated, use_cpu=True, bf16=False,
        report_to="none", save_strategy="no",
        shuffle_dataset=False)
    data = Dataset.from_dict({"prompt": ["t5 t6"] * GROUPS, "row": list(range(GROUPS))})
    # Loaded here (TRL's own loading wants config.architectures, which rhyme-jax's imports omit);
    # with beta > 0 TRL loads its reference from the model's directory (config._name_or_path)
    # with the model's dtype and attention implementation.
    model = AutoModelForCausalLM.from_pretrained(str(setup.ref_dir), dtype=torch.float32, attn_implementation="eager")
    trainer = GRPOTrainer(model=model, reward_funcs=reward_funcs or fixed_reward, args=args, train_dataset=data,
                          processing_class=setup.tokenizer, rollout_func=rollout)
    if setup.policy_sd is not None:
        trainer.model.load_state_dict(setup.policy_sd)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _trl_step(trainer, noise_seed: int = 3, noise_std: float = 0.3):
    """TRL's generation batch (with behaviour logprobs = current + noise), the current logprobs
    and the first slice's loss and gradients (HF parameter name -> numpy)."""
    out = trainer._generate_and_score_completions([{"prompt": "t5 t6", "row": i} for i in range(ROWS)])
    current = out["old_per_token_logps"]  # GA=1 < steps_per_generation: TRL scores the batch itself
    noise = torch.from_numpy(np.random.default_rng(noise_seed).normal(0.0, noise_std, tuple(current.shape)))
    out["old_per_token_logps"] = current + noise.float() * out["completion_mask"]
    first = {k: (v[: ROWS // MINIBATCHES] if torch.is_tensor(v) and v.ndim > 0 else v) for k, v in out.items()}
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, first)
    loss.backward()
    grads = {k: p.grad.detach().numpy().copy() for k, p in trainer.model.named_parameters()}
    return out, current.numpy(), float(loss.detach()), grads


def _our_batch(setup: Setup, out, current_trl, loss_agg, scale_rewards, beta, logprob_atol, mask_truncated=False):
    """The step's batch as ``trainer._update`` builds it (all ROWS rows; ``mask_truncated``: the
    rows without EOS masked, ``grpo.mask_truncated_completions``); checks our current and
    reference logprobs against TRL's."""
    cfg, graphdef, state, ref_state = _ours(setup.policy_dir, setup.ref_dir)
    prompts, completions, rewards = _rollout_data(setup)
    adv = np.asarray(losses.group_advantages(jnp.asarray(rewards.reshape(GROUPS, N)),
                                             scale_rewards=scale_rewards)).reshape(-1)
    batch = losses.sequence_batch(prompts, completions, setup.pad)
    seq_len = batch["tokens"].shape[1]
    prompt_lens = batch.pop("prompt_lens")
    batch.pop("lengths")
    old = [out["old_per_token_logps"][i, : len(c)].numpy() for i, c in enumerate(completions)]
    batch["old_logprobs"] = losses.response_grid(old, prompt_lens, seq_len)
    batch["advantages"] = adv.astype(np.float32)
    if mask_truncated:
        batch["loss_mask"] = mask_rows(batch["loss_mask"], np.array([c[-1] != setup.eos for c in completions]))
    norm = losses.loss_normaliser(loss_agg, response_tokens=int(np.count_nonzero(batch["loss_mask"])), rows=ROWS,
                                  minibatches=MINIBATCHES, max_new_tokens=MAX_NEW)
    batch["loss_norm"] = np.full(ROWS, norm, np.float32)
    on_grid = lambda grid: np.stack([grid[i, PROMPT_LEN - 1: PROMPT_LEN - 1 + MAX_NEW] for i in range(ROWS)])
    current = np.asarray(_logprob_fn(graphdef)(state, batch))
    mask = out["completion_mask"].numpy() > 0
    np.testing.assert_allclose(on_grid(current)[mask], current_trl[mask], rtol=0, atol=logprob_atol)
    if beta > 0:
        batch["ref_logprobs"] = np.asarray(_logprob_fn(graphdef)(ref_state, batch))
        np.testing.assert_allclose(on_grid(batch["ref_logprobs"])[mask], out["ref_per_token_logps"].numpy()[mask],
                                   rtol=0, atol=logprob_atol)
    return batch, adv, current


def _rel(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / max(np.max(np.abs(b)), 1e-30))


def _compare_grads(cfg, grads, trl_grads, rtol: float) -> float:
    """Worst per-tensor relative error of our gradient against TRL's, HF names mapped to ours."""
    from flax import nnx

    flat = {path: v.get_value() if hasattr(v, "get_value") else v for path, v in nnx.to_flat_state(grads)}
    worst = 0.0
    for name, target in key_map(cfg).items():
        g = np.asarray(flat[target.path])
        g = g[target.layer] if target.layer is not None else g
        g = g.T if target.transpose else g
        rel = _rel(g, trl_grads[name])
        assert rel < rtol, f"{name}: relative error {rel:.2e}"
        worst = max(worst, rel)
    assert set(trl_grads) == set(key_map(cfg)), "every TRL parameter is mapped"
    return worst


def _assert_clipping_on_both_sides(batch, current_grid):
    """Ratios of the first minibatch hit the upper clip with A > 0 and the lower with A < 0."""
    rows = ROWS // MINIBATCHES
    mask = batch["loss_mask"][:rows, :-1] > 0
    ratio = np.exp(current_grid[:rows] - batch["old_logprobs"][:rows])
    adv = batch["advantages"][:rows, None]
    assert np.any(mask & (adv > 0) & (ratio > 1 + EPS_HIGH)) and np.any(mask & (adv < 0) & (ratio < 1 - EPS_LOW))


def _assert_sequence_clipping(batch, current_grid):
    """GSPO: some row of the first minibatch has its sequence ratio outside the clip range."""
    rows = ROWS // MINIBATCHES
    mask = batch["loss_mask"][:rows, :-1]
    log_iw = np.sum((current_grid[:rows] - batch["old_logprobs"][:rows]) * mask, 1) / np.maximum(mask.sum(1), 1)
    ratio, adv = np.exp(log_iw), batch["advantages"][:rows]
    assert np.any(((adv > 0) & (ratio > 1 + EPS_HIGH)) | ((adv < 0) & (ratio < 1 - EPS_LOW))), ratio


def check_case(setup: Setup, tmp_path, monkeypatch, loss_type, scale_rewards, beta, bias_correction,
               micro_batch_tokens=0, logprob_atol=2e-5, grad_rtol=GRAD_RTOL, is_level="token", entropy_coef=0.0,
               mask_truncated=False):
    """One TRL configuration against ours; returns (loss rel. error, worst gradient rel. error).
    ``is_level`` / ``entropy_coef`` / ``mask_truncated``: TRL ``importance_sampling_level`` /
    ``entropy_coef`` / ``mask_truncated_completions``."""
    trainer = _trl_trainer(setup, tmp_path, monkeypatch, loss_type, scale_rewards, beta, bias_correction,
                           is_level, entropy_coef, mask_truncated=mask_truncated)
    # a sequence ratio averages the noise over the row's tokens: more of it to clip some rows
    out, current_trl, trl_loss, trl_grads = _trl_step(trainer, noise_std=0.3 if is_level == "token" else 1.0)
    cfg, graphdef, state, _ = _ours(setup.policy_dir, setup.ref_dir)
    loss_agg = LOSS_TYPES[loss_type]
    batch, adv, current = _our_batch(setup, out, current_trl, loss_agg, scale_rewards, beta, logprob_atol,
                                     mask_truncated)
    np.testing.assert_allclose(adv, out["advantages"].numpy(), rtol=1e-5, atol=1e-6)  # TRL's advantages
    assert np.any(adv > 0) and np.any(adv < 0)
    _assert_clipping_on_both_sides(batch, current)
    if is_level == "sequence":
        _assert_sequence_clipping(batch, current)
    first = {k: v[: ROWS // MINIBATCHES] for k, v in batch.items()}  # minibatch 0 (np.array_split)
    (loss, _), grads = _our_grads(graphdef, state, first, loss_agg, beta, bias_correction, micro_batch_tokens,
                                  is_level, entropy_coef)
    loss_rel = abs(float(loss) - trl_loss) / abs(trl_loss)
    assert loss_rel < LOSS_RTOL, (float(loss), trl_loss)
    worst = _compare_grads(cfg, grads, trl_grads, grad_rtol)
    MEASURED[f"{setup.policy_dir.name}-{loss_type}-{scale_rewards}-{beta}-{bias_correction}-{micro_batch_tokens}"
             f"-{is_level}-{entropy_coef}{'-masked' if mask_truncated else ''}"] = (loss_rel, worst)
    return loss_rel, worst


CASES = [(lt, sr, beta, bc) for lt in LOSS_TYPES for sr in ("group", "batch", "none")
         for beta, bc in ((0.0, False), (BETA, False), (BETA, True))]


@pytest.mark.parametrize("loss_type,scale_rewards,beta,bias_correction", CASES,
                         ids=[f"{lt}-{sr}-beta{b}-{'iskl' if bc else 'k3'}" for lt, sr, b, bc in CASES])
def test_loss_and_gradients_match_trl(tiny, tmp_path, monkeypatch, loss_type, scale_rewards, beta, bias_correction):
    check_case(tiny, tmp_path, monkeypatch, loss_type, scale_rewards, beta, bias_correction)


def test_micro_batched_update_matches_trl(tiny, tmp_path, monkeypatch):
    """The update's own entry point (``make_grads_fn``: weights from ``batch["loss_norm"]``, then
    the gradient accumulated over 3 micro-batches of 2 rows) against the same TRL step."""
    seq_len = losses.sequence_batch(*_rollout_data(tiny)[:2], tiny.pad)["tokens"].shape[1]
    check_case(tiny, tmp_path, monkeypatch, "dapo", "batch", BETA, True, micro_batch_tokens=2 * seq_len)


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo", "dr_grpo"])
def test_masked_truncated_completions_match_trl(tiny, tmp_path, monkeypatch, loss_type):
    """``grpo.mask_truncated_completions`` against TRL's ``mask_truncated_completions=True``: row 4
    (cut at MAX_NEW, in minibatch 0) carries no loss; the token counts of ``token_mean`` and the
    ``step_token_mean`` normaliser leave it out, ``dr_grpo``'s rows still count it. (TRL ``grpo``
    averages its row means over all rows, the masked one as 0; ``seq_mean_token_mean`` leaves
    rows without loss tokens out of the mean: docs/trl_mapping.md.)"""
    check_case(tiny, tmp_path, monkeypatch, loss_type, "group", BETA, False, mask_truncated=True)


# GSPO (importance_sampling_level="sequence") and the entropy bonus: (loss_type, scale_rewards, beta,
# use_bias_correction_kl, importance_sampling_level, entropy_coef)
OPTION_CASES = [("grpo", "group", 0.0, False, "sequence", 0.0), ("grpo", "group", BETA, True, "sequence", 0.0),
                ("dapo", "batch", BETA, False, "sequence", 0.0), ("bnpo", "none", 0.0, False, "sequence", 0.0),
                ("grpo", "group", 0.0, False, "token", 0.05), ("dr_grpo", "group", BETA, True, "token", 0.05),
                ("dapo", "group", BETA, True, "sequence", 0.05)]


@pytest.mark.parametrize("loss_type,scale_rewards,beta,bias_correction,is_level,entropy_coef",
                         # CI time: cases 1, 3, 5 slow; the others still cover every option
                         [pytest.param(*c, marks=pytest.mark.slow) if i in (1, 3, 5) else c
                          for i, c in enumerate(OPTION_CASES)],
                         ids=[f"{c[0]}-{c[1]}-beta{c[2]}-{'iskl' if c[3] else 'k3'}-{c[4]}-ent{c[5]}"
                              for c in OPTION_CASES])
def test_gspo_and_entropy_bonus_match_trl(tiny, tmp_path, monkeypatch, loss_type, scale_rewards, beta,
                                          bias_correction, is_level, entropy_coef):
    """``grpo.importance_sampling_level`` / ``grpo.entropy_coef`` against TRL's keys of the same names."""
    check_case(tiny, tmp_path, monkeypatch, loss_type, scale_rewards, beta, bias_correction, is_level=is_level,
               entropy_coef=entropy_coef)


def test_micro_batched_gspo_with_entropy_bonus_matches_trl(tiny, tmp_path, monkeypatch):
    """The sequence ratio and the entropy bonus through ``make_grads_fn`` over 3 micro-batches."""
    seq_len = losses.sequence_batch(*_rollout_data(tiny)[:2], tiny.pad)["tokens"].shape[1]
    check_case(tiny, tmp_path, monkeypatch, "grpo", "group", BETA, True, micro_batch_tokens=2 * seq_len,
               is_level="sequence", entropy_coef=0.05)


REWARD_MODULE = '''
def correct(responses, problems, scale=1.0):
    return [scale * (len(r.split()) % 3 == 0) for r in responses]

def short(responses, problems):
    # None: not applicable to this sample (TRL's convention)
    return [None if len(r.split()) > 6 else 1.0 - len(r.split()) / 6 for r in responses]
'''


def test_weighted_reward_fns_match_trl(tiny, tmp_path, monkeypatch):
    """``reward.fns`` (two functions, weights 1.0 and -0.5, one returning None for some samples)
    against TRL's ``reward_funcs`` + ``reward_weights`` on the same completions: the combined
    reward (NaN-aware weighted sum), the group advantages and each function's logged mean."""
    import sys

    from rhyme_jax.config import load_config
    from rhyme_jax.data.custom_reward import load_reward, score_terms
    from rhyme_jax.data.problems import Problem

    (tmp_path / "two_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "two_rewards", raising=False)
    cfg = load_config(None, ["reward.fns=[{fn: 'two_rewards:correct', weight: 1.0, kwargs: {scale: 2.0}, "
                             "batched: true}, {fn: 'two_rewards:short', weight: -0.5, batched: true}]"])
    ours = load_reward(cfg.reward)
    mod = __import__("two_rewards")

    def trl_fn(f, **kw):
        def reward(prompts, completions, **_):
            return f(completions, [None] * len(completions), **kw)
        reward.__name__ = f.__name__
        return reward

    trainer = _trl_trainer(tiny, tmp_path, monkeypatch, "grpo", "group", 0.0, False,
                           reward_funcs=[trl_fn(mod.correct, scale=2.0), trl_fn(mod.short)],
                           reward_weights=[1.0, -0.5])
    out = trainer._generate_and_score_completions([{"prompt": "t5 t6", "row": i} for i in range(ROWS)])
    texts = trainer.processing_class.batch_decode(_rollout_data(tiny)[1], skip_special_tokens=True)
    problems = [Problem(id=i, question="q", solution="#### a", answer="a") for i in range(ROWS)]
    rewards, means = score_terms(ours, texts, problems)
    values = ours.per_function(texts, problems)
    assert np.isnan(values[:, 1]).any() and not np.isnan(values).all(axis=1).any()  # None exercised
    assert len(set(rewards)) > 2
    trl_rewards = np.nansum(values * np.array([1.0, -0.5]), axis=1)  # TRL's reward: nansum of weighted
    np.testing.assert_allclose(rewards, trl_rewards, rtol=1e-6)
    adv = np.asarray(losses.group_advantages(jnp.asarray(np.array(rewards, np.float32).reshape(GROUPS, N)))).reshape(-1)
    np.testing.assert_allclose(adv, out["advantages"].numpy(), rtol=1e-5, atol=1e-6)  # TRL's advantages
    logged = {k: np.mean(v) for k, v in trainer._metrics["train"].items()}
    for name in ("correct", "short"):
        np.testing.assert_allclose(means[f"reward/{name}/mean"], logged[f"rewards/{name}/mean"], rtol=1e-6)
    np.testing.assert_allclose(np.mean(rewards), logged["reward"], rtol=1e-6)


@pytest.mark.slow
def test_smollm2_loss_and_gradients_match_trl(smollm2_dir, tmp_path, monkeypatch):
    """SmolLM2-135M-Instruct (30 layers, GQA, tied embeddings, 49k vocabulary), the policy being
    the checkpoint itself: TRL's dapo / group scaling / beta 0 against ours (about 40 s on 2 CPU
    cores, hence slow). Gradients within 5e-4: float32 is the limit at this depth, TRL's float32
    gradient differs from its own float64 one by up to 1.0e-4 per tensor and ours by up to
    2.3e-4 (measured; RMSNorm weights the worst); the loss still agrees within 1e-5."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    setup = Setup(Path(smollm2_dir), Path(smollm2_dir), None, tok, tok.vocab_size, tok.eos_token_id,
                  tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    check_case(setup, tmp_path, monkeypatch, "dapo", "group", 0.0, False, logprob_atol=1e-4, grad_rtol=5e-4)


TIS_CAP = 2.0  # grpo.tis_cap = TRL vllm_importance_sampling_clip_max


def test_truncated_importance_sampling_matches_trl(tiny, tmp_path, monkeypatch):
    """``grpo.tis`` against TRL's ``vllm_importance_sampling_correction`` in mode ``token_truncate``
    (clip_max = ``grpo.tis_cap``, no clip_min). The behaviour logprobs of the harness (current + noise)
    play the trainer's old logprobs; the sampler's are those plus more noise (a bf16 engine's),
    some past log(cap) so the cap is active. TRL's ratio is computed by its formula
    (``clamp(exp((old - sampling) * mask), max=cap)``: inline in ``_generate_and_score_completions``,
    which needs vLLM) and handed to TRL's own ``_compute_loss`` with the vLLM correction switched
    on; ours from ``tis.truncated_is_weights`` into the update's gradient (``batch["is_weights"]``).
    The weights agree to the float32 rounding of one ``exp`` (``f32.TRANSCENDENTAL_ULPS``), the loss
    and gradients within the tolerances of the other cases. KL on (beta > 0): TRL adds it after the
    weighting, so it stays unweighted."""
    from rhyme_jax.train import tis
    import f32

    trainer = _trl_trainer(tiny, tmp_path, monkeypatch, "bnpo", "group", BETA, False)
    out = trainer._generate_and_score_completions([{"prompt": "t5 t6", "row": i} for i in range(ROWS)])
    current_trl = out["old_per_token_logps"].numpy()
    mask = out["completion_mask"]
    rng = np.random.default_rng(3)
    old = out["old_per_token_logps"] + torch.from_numpy(rng.normal(0.0, 0.3, tuple(mask.shape))).float() * mask
    sampling = old + torch.from_numpy(rng.normal(0.0, 0.5, tuple(mask.shape))).float() * mask
    ratio = torch.clamp(torch.exp((old - sampling) * mask), max=TIS_CAP)  # TRL token_truncate
    out["old_per_token_logps"], out["importance_sampling_ratio"] = old, ratio
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    trainer.vllm_importance_sampling_mode = "token_truncate"
    first = {k: (v[: ROWS // MINIBATCHES] if torch.is_tensor(v) and v.ndim > 0 else v) for k, v in out.items()}
    trainer.model.zero_grad()
    loss_t = trainer._compute_loss(trainer.model, first)
    loss_t.backward()
    loss_t = float(loss_t.detach())
    trl_grads = {k: p.grad.detach().numpy().copy() for k, p in trainer.model.named_parameters()}

    cfg, graphdef, state, _ = _ours(tiny.policy_dir, tiny.ref_dir)
    batch, _, _ = _our_batch(tiny, out, current_trl, "token_mean", "group", BETA, 2e-5)
    completions = _rollout_data(tiny)[1]
    prompt_lens = np.full(ROWS, PROMPT_LEN, np.int32)
    sampler = losses.response_grid([sampling[i, : len(c)].numpy() for i, c in enumerate(completions)],
                                   prompt_lens, batch["tokens"].shape[1])
    weights, metrics = tis.truncated_is_weights(batch["old_logprobs"], sampler, batch["loss_mask"][:, :-1], TIS_CAP)
    on_grid = lambda grid: np.stack([grid[i, PROMPT_LEN - 1: PROMPT_LEN - 1 + MAX_NEW] for i in range(ROWS)])
    m = mask.numpy() > 0
    np.testing.assert_allclose(on_grid(np.asarray(weights))[m], ratio.numpy()[m],
                               rtol=f32.TRANSCENDENTAL_ULPS * f32.U, atol=0)
    assert 0 < float(metrics["tis/clipped_fraction"]) < 0.5 and float(metrics["tis/weight_max"]) == TIS_CAP
    batch["is_weights"] = np.asarray(weights)
    first_ours = {k: v[: ROWS // MINIBATCHES] for k, v in batch.items()}
    (loss, _), grads = _our_grads(graphdef, state, first_ours, "token_mean", BETA, False)
    assert abs(float(loss) - loss_t) / abs(loss_t) < LOSS_RTOL, (float(loss), loss_t)
    _compare_grads(cfg, grads, trl_grads, GRAD_RTOL)
    # the weighting matters here: without it the loss is another number
    (plain, _), _ = _our_grads(graphdef, state, {k: v for k, v in first_ours.items() if k != "is_weights"},
                               "token_mean", BETA, False)
    assert abs(float(plain) - loss_t) / abs(loss_t) > 100 * LOSS_RTOL


def test_zz_report_measured_errors():
    """Prints the worst relative errors of the cases that ran (``pytest -s``)."""
    if MEASURED:
        loss = max(v[0] for v in MEASURED.values())
        grad = max(v[1] for v in MEASURED.values())
        print(f"\nTRL parity over {len(MEASURED)} cases: loss rel. error <= {loss:.2e}, "
              f"gradient rel. error <= {grad:.2e}")
