"""The FLOP count of the regime report (``rhyme_lab/ablate/regime_flops.py``): the products' weights
are the model's own kernels and head, the attention's pairs are causal, and the per-epoch rates and
shares follow from a unit's seconds."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from rhyme_jax.model.config import ModelConfig
from rhyme_jax.model.transformer import Decoder
from rhyme_lab.ablate import regime_flops

CFG = ModelConfig(family="qwen3", vocab_size=96, hidden_size=32, intermediate_size=80, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8, rope_theta=1e4, tie_word_embeddings=True, qk_norm=True,
                  attention_bias=False, max_position_embeddings=512, eos_token_ids=(1,))


def test_matmul_params_are_the_models_kernels_and_its_head():
    state = nnx.state(Decoder(CFG, rngs=nnx.Rngs(0)), nnx.Param)
    kernels = sum(leaf.size for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
                  if "kernel" in jax.tree_util.keystr(path))
    head = CFG.hidden_size * CFG.vocab_size  # tied: the embedding matrix is the head's
    assert regime_flops.matmul_params(CFG) == kernels + head == 3 * (32 * 32 * 2 + 32 * 16 * 2 + 3 * 32 * 80) + 32 * 96


def test_forward_flops_count_products_per_token_and_causal_pairs():
    n_mat = regime_flops.matmul_params(CFG)
    per_pair = CFG.num_layers * 4 * CFG.num_heads * CFG.head_dim
    assert regime_flops.forward_flops(CFG, [1]) == 2 * n_mat + per_pair
    # two rows of 3 and 5 tokens: 8 tokens, 6 + 15 (query, earlier-or-same key) pairs
    assert regime_flops.forward_flops(CFG, [3, 5]) == 2 * n_mat * 8 + per_pair * 21
    # a long row's pairs grow with its square: doubling it more than doubles the FLOPs
    assert regime_flops.forward_flops(CFG, [4096]) > 2 * regime_flops.forward_flops(CFG, [2048])


def test_epoch_rates_give_each_phases_rate_and_the_share_of_the_gap():
    steps = [{"step": 1, "rollout/epoch": 1, "compiles": 1, "plain": {"seconds": 9.0}, "spec": {"seconds": 9.0},
              "time/train_s": 9.0, "wall_s": 30.0},  # compiled: left out
             {"step": 2, "rollout/epoch": 1, "compiles": 0, "plain": {"seconds": 4.0}, "spec": {"seconds": 3.0},
              "time/train_s": 1.5, "wall_s": 9.0},
             {"step": 3, "rollout/epoch": 1, "compiles": 0, "plain": {"seconds": 6.0}, "spec": {"seconds": 5.0},
              "time/train_s": 2.5, "wall_s": 14.0}]
    flops = {1: (5e9, 5e9), 2: (2e9, 2e9), 3: (3e9, 3e9)}
    (row,) = regime_flops.epoch_rates({"steps": steps, "skip": 0}, flops)
    assert row["epoch"] == 1 and row["steps"] == 2
    assert row["rollout_gflops"] == pytest.approx(5.0 / 10.0)  # 5 GFLOP over 10 s of plain rollout
    assert row["update_gflops"] == pytest.approx(3 * 5.0 / 4.0)  # 3x the FLOPs over 4 s of update
    assert row["gap"] == pytest.approx(7.5) and row["updated"] == 1.0
    assert row["share"] == pytest.approx(10.0 / (10.0 + 2.0 + 3.0))  # rest: wall - both rollouts
    assert row["share_of_gap"] == pytest.approx(1 / (1 + 3 / 7.5))
    lines = regime_flops.table_lines([row])
    assert lines[2].startswith("| 1 | 2 | 2.5 | 0.50 | 3.75 | 7.50 | 3 x 1.00 |")
    assert np.isclose(1 / (1 + 3 / 7), 0.7)  # the module's "70% needs 7x"
    # an update over a fifth of the rows' FLOPs in the same 4 s: a fifth of the rate, the same share
    (part,) = regime_flops.epoch_rates({"steps": steps, "skip": 0}, {k: (f, f / 5) for k, (f, _) in flops.items()})
    assert part["update_gflops"] == pytest.approx(3 * 1.0 / 4.0) and part["updated"] == pytest.approx(0.2)
    assert part["share_of_gap"] == pytest.approx(row["share_of_gap"])


def test_updated_rows_leave_out_what_the_update_skips():
    from rhyme_jax.config import load_config

    rewards = np.array([1, 0, 1, 0] + [0, 0, 0, 0], np.float32)  # the second group's rewards are all equal
    lengths = np.array([5, 16, 0, 7, 3, 16, 2, 4])
    base = ["grpo.samples_per_prompt=4", "grpo.prompts_per_step=2", "rollout.max_new_tokens=16",
            "rollout.max_prompt_len=16", "grpo.padding_free=true"]
    rows = lambda *sets: regime_flops.updated_rows(load_config("configs/tiny_test.yaml", base + list(sets)),  # noqa: E731
                                                   rewards, lengths).tolist()
    assert rows() == [True, True, False, True, True, True, True, True]  # empty responses only
    assert rows("grpo.skip_zero_advantage_rows=true") == [True, True, False, True] + [False] * 4
    assert rows("grpo.dynamic_sampling=true", "grpo.mask_truncated_completions=true") == [True, False, False, True] + [False] * 4
