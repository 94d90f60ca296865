"""GRPO with HistoSpec on: drafts from the second epoch, history write-back, history in the
checkpoint and exact resumption (tiny config, 2 prompts cycled so every step is a new epoch)."""

from __future__ import annotations

import numpy as np
import pytest

from rhyme_jax.io.checkpoint import Checkpointer
from rhyme_jax.spec.history import HistoryStore
from rhyme_jax.train.trainer import GRPOTrainer
from test_trainer import (STEPS, assert_trees_equal, host_copy, parity_reward, tiny_cfg, train_rows,
                          train_steps_by_hand)

SPEC = ("spec.enabled=true", "grpo.num_prompts=2", "spec.window=fixed", "spec.fixed_window=4",
        "spec.min_token_prob=0.0", "spec.pattern_min=1", "spec.pattern_max=2")  # untrained model: short matches
# Wall-time metrics differ between identical runs.
VOLATILE = ("time/", "rollout/tokens_per_s", "spec/drafting")


@pytest.fixture(scope="module")
def spec_run(tmp_path_factory):
    trainer = GRPOTrainer(tiny_cfg(tmp_path_factory.mktemp("spec"), *SPEC), reward_fn=parity_reward)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return trainer


def test_drafts_start_in_the_second_epoch(spec_run):
    rows = train_rows(spec_run.run_dir)
    assert [rows[s]["rollout/epoch"] for s in (1, 2, 3, 4)] == [1.0, 2.0, 3.0, 4.0]
    assert rows[1]["spec/drafted_tokens"] == 0  # cold start: plain decode
    for s in (2, 3, 4):
        assert rows[s]["spec/drafted_tokens"] > 0
        assert 0 <= rows[s]["spec/accepted_tokens"] <= rows[s]["spec/drafted_tokens"]
    # History holds each prompt's last rollout: the 4 samples of step 4.
    hist = spec_run.history
    assert sorted(hist.prompt_ids()) == sorted(set(hist.prompt_ids())) and len(hist) == 2
    for pid in hist.prompt_ids():
        (ro,) = hist.entry(pid).rollouts
        assert ro.step == STEPS and len(ro.responses) == 4


def test_history_is_saved_with_the_checkpoint(spec_run):
    with Checkpointer(spec_run.run_dir / "checkpoints") as c:
        blobs = c.restore_blobs(STEPS)
    saved = HistoryStore.from_bytes(blobs["history"], source="test")
    assert sorted(saved.prompt_ids()) == sorted(spec_run.history.prompt_ids())
    for pid in saved.prompt_ids():
        a, b = saved.entry(pid), spec_run.history.entry(pid)
        np.testing.assert_array_equal(a.prompt, b.prompt)
        for ra, rb in zip(a.rollouts, b.rollouts):
            assert ra.step == rb.step
            np.testing.assert_array_equal(ra.rewards, rb.rewards)
            for x, y in zip(ra.responses, rb.responses):
                np.testing.assert_array_equal(x, y)


def test_resume_with_history_is_bit_identical(spec_run, tmp_path):
    cfg = tiny_cfg(tmp_path, *SPEC)
    train_steps_by_hand(cfg, (1, 2))
    second = GRPOTrainer(cfg, resume=True, reward_fn=parity_reward)
    try:
        assert second.step == 2 and len(second.history) == 2
        second.fit()
    finally:
        second.close()
    assert_trees_equal(host_copy(second.state), host_copy(spec_run.state))
    want, got = train_rows(spec_run.run_dir), train_rows(second.run_dir)
    for step in (1, 2, 3, 4):
        for key, value in want[step].items():
            if not key.startswith(VOLATILE):
                assert got[step][key] == value, (step, key)


@pytest.mark.slow  # ~100 s on 2 busy cores; test_attach_pass_cost_* covers the wiring in the default set
def test_goodput_run_loads_its_step_cost_and_logs_predicted_acceptance(tmp_path):
    """spec.window=goodput end to end: the pass-cost file reaches every engine (a profile in which
    every program of a row bucket costs the same: drafting is free, so the engine sends drafts) and
    the metrics carry the drafter's predicted acceptance beside the observed one."""
    from rhyme_jax.rollout.shapes import programs_from_config
    from rhyme_jax.rollout.pass_cost import PassCost

    base = tiny_cfg(tmp_path, *SPEC)
    flat = PassCost({(p.rows, p.tokens, p.q_len): 1.0 for p in programs_from_config(base) if p.kind != "prefill"})
    path = flat.save(tmp_path / "flat_cost.json")
    cfg = tiny_cfg(tmp_path, *SPEC, "spec.window=goodput", f"spec.step_cost={path}", "grpo.steps=2",
                   "spec.self_lookup=true", "spec.siblings=true")
    trainer = GRPOTrainer(cfg, reward_fn=parity_reward)
    try:
        assert all(e.pass_cost.seconds == flat.seconds for e in trainer.rollout.engines)
        trainer.fit()
    finally:
        trainer.close()
    rows = train_rows(trainer.run_dir)
    assert rows[2]["spec/drafted_tokens"] > 0
    assert 0.0 < rows[2]["spec/predicted_acceptance"] < 1.0
    assert 0.0 <= rows[2]["spec/acceptance_rate"] <= 1.0


def test_attach_pass_cost_gives_every_engine_the_first_engines_model(tmp_path):
    from types import SimpleNamespace

    from rhyme_jax.rollout.pass_cost import PassCost
    from rhyme_jax.train.assembly import attach_pass_cost

    class Engine:
        def __init__(self):
            self.pass_cost, self.calls = PassCost.prior(), []

        def use_pass_cost(self, state, sampling, path=""):
            self.calls.append((state, path))
            self.pass_cost = PassCost({(1, 1, 1): 2.0})
            return self.pass_cost

    engines = [Engine(), Engine()]
    parts = SimpleNamespace(engines=engines, states=lambda s: [f"{s}@w0", f"{s}@w1"])
    attach_pass_cost(tiny_cfg(tmp_path, *SPEC), parts, "state")  # window=fixed: nothing to do
    assert engines[0].calls == [] and engines[1].pass_cost.meta == {"source": "prior"}
    attach_pass_cost(tiny_cfg(tmp_path, *SPEC, "spec.window=goodput", "spec.step_cost=prior"), parts, "state")
    assert engines[0].calls == [("state@w0", "prior")] and engines[1].calls == []
    assert engines[1].pass_cost is engines[0].pass_cost
