"""GRPOTrainer end to end on the tiny config: exact resumption (in process and after SIGKILL),
non-finite steps, over-long prompts, malformed GSM8K data.

Every run uses ``configs/tiny_test.yaml`` (2-layer, hidden-32 model; 4 GRPO steps of 2 prompts x 4
samples). The task reward of such an untrained model is always 0, which gives zero advantages and
hence no parameter change, so resumption would be tested vacuously; the runs here use
``parity_reward`` (1 if the decoded response has odd length) instead: deterministic, mixed within
groups, so every step moves the parameters.

A persistent XLA compilation cache (under pytest's session temp dir, shared with test_cli.py and
the CLI subprocesses) keeps the repeated compiles of identical programs out of the run time.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest

import f32
from rhyme_jax.config import load_config
from rhyme_jax.data import DataError, load_problems
from rhyme_jax.io.checkpoint import Checkpointer
from rhyme_jax.io.metrics import read_metrics
from rhyme_jax.io.rollout_log import load_rollouts
from rhyme_jax.rollout.engine import PromptTooLongError
from rhyme_jax.train.callbacks import TrainerCallback
from rhyme_jax.train.prompts import prompt_schedule
from rhyme_jax.train.trainer import GRPOTrainer, NonFiniteLossError

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tiny_test.yaml"
STEPS, PROMPTS, SAMPLES = 4, 2, 4  # grpo.steps, prompts_per_step, samples_per_prompt of tiny_test
PER_STEP = PROMPTS * SAMPLES  # reward calls per GRPO step
# Metric keys that measure wall time (differ between identical runs).
TIMING_KEYS = ("time/rollout_s", "time/train_s", "rollout/tokens_per_s", "time/rollout_wait_s",
               "time/rollout_makespan_s")


def parity_reward(text, problem):
    """Dense deterministic stand-in verifier (see the module docstring). The CLI subprocesses
    install the same expression through ``_BOOT``."""
    return float(len(text) % 2)


# ``python -c _BOOT train ...`` is ``python -m rhyme_jax.cli train ...`` with ``parity_reward`` as
# the GRPO reward (``cli.main(reward_fn=...)``; the command line has no reward option).
# RHYME_TEST_BLOCK_AT_CALL=k parks the process in its k-th reward call until the test SIGKILLs it:
# a deterministic mid-run kill point.
_BOOT = textwrap.dedent("""
    import os, sys, time
    calls = 0
    block_at = int(os.environ.get("RHYME_TEST_BLOCK_AT_CALL", "0"))
    def parity_reward(text, problem):
        global calls
        calls += 1
        if calls == block_at:
            while True:
                time.sleep(60)
        return float(len(text) % 2)
    from rhyme_jax.cli import main
    sys.exit(main(sys.argv[1:], reward_fn=parity_reward))
""")


def tiny_cfg(runs_dir, *overrides):
    return load_config(CONFIG, [f"run.runs_dir={runs_dir}", *overrides])


def host_copy(tree):
    """Numpy copy of every leaf (device buffers are donated by later steps)."""
    return jax.tree.map(lambda x: np.array(x), tree)


def assert_trees_equal(a, b):
    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [jax.tree_util.keystr(p) for p, _ in la] == [jax.tree_util.keystr(p) for p, _ in lb]
    assert la, "empty tree"
    for (path, x), (_, y) in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
        assert np.array_equal(x, y), f"leaf {jax.tree_util.keystr(path)} differs"


def trees_differ(a, b) -> bool:
    return any(not np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def train_rows(run_dir) -> dict[int, dict]:
    """Train-phase metric rows by step; fails on a duplicated step."""
    rows = [r for r in read_metrics(run_dir) if r["phase"] == "train"]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"duplicate train steps in metrics.jsonl: {steps}"
    return {r["step"]: r for r in rows}


def comparable(row: dict) -> dict:
    """A metrics row without timing keys, NaN replaced by a marker (NaN != NaN)."""
    return {k: ("nan" if isinstance(v, float) and math.isnan(v) else v)
            for k, v in row.items() if k not in TIMING_KEYS}


def restore(run_dir, step, like):
    with Checkpointer(Path(run_dir) / "checkpoints") as c:
        params, opt_state, meta = c.restore(step, params_like=like.state, opt_state_like=like.opt_state)
    return host_copy(params), host_copy(opt_state), meta


class Recorder(TrainerCallback):
    """Records every callback event with host copies of what it received (``train/callbacks.py``)."""

    def __init__(self):
        self.events, self.wrapped, self.generate_calls, self.submit_wraps, self.submitted = [], 0, 0, 0, []

    def wrap_generate(self, generate):
        self.wrapped += 1

        def counted(*args, **kw):
            self.generate_calls += 1
            return generate(*args, **kw)
        return counted

    def wrap_submit(self, submit, scheduler):
        self.submit_wraps += 1

        def logged(step, *args, **kw):
            self.submitted.append(step)
            return submit(step, *args, **kw)
        return logged

    def on_rollout_end(self, trainer, step, batch):
        self.events.append(("rollout_end", step, SimpleNamespace(
            batch_step=batch.step, ids=batch.ids.copy(), tokens=[t.tolist() for t in batch.tokens],
            rewards=batch.rewards.copy())))

    def on_before_update(self, trainer, step, state, batch):
        self.events.append(("before_update", step, SimpleNamespace(params=host_copy(state), rows=len(batch.tokens))))

    def on_update_end(self, trainer, step, state, minibatch_metrics):
        self.events.append(("update_end", step, SimpleNamespace(params=host_copy(state),
                                                                minibatches=list(minibatch_metrics))))

    def on_step_end(self, trainer, step, metrics):
        self.events.append(("step_end", step, dict(metrics)))

    def on_train_end(self, trainer):
        self.events.append(("train_end", trainer.step, SimpleNamespace(
            gantt=(trainer.run_dir / "gantt.png").exists(),
            eval_steps=[r["step"] for r in read_metrics(trainer.run_dir) if r["phase"] == "eval"])))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, compile_cache):
    """One uninterrupted 4-step run (fit) shared by the resumption tests, with a ``Recorder``
    callback attached (the runs it is compared with have none: callbacks change nothing)."""
    runs = tmp_path_factory.mktemp("reference")
    recorder = Recorder()
    trainer = GRPOTrainer(tiny_cfg(runs), reward_fn=parity_reward, callbacks=[recorder])
    init = host_copy(trainer.state)
    try:
        result = trainer.fit()
    finally:
        trainer.close()
    return SimpleNamespace(run_dir=trainer.run_dir, trainer=trainer, init=init, result=result,
                           params=host_copy(trainer.state), opt_state=host_copy(trainer.opt_state),
                           rows=train_rows(trainer.run_dir), recorder=recorder)


def test_reference_run_learns_from_a_nonzero_signal(reference):
    """Guards the resumption tests against passing vacuously."""
    assert sorted(reference.rows) == [1, 2, 3, 4]
    assert reference.result["steps"] == STEPS
    for row in reference.rows.values():
        assert row["finite"] == 1.0
        assert row["nonfinite/skipped_total"] == 0.0 and row["rollout/skipped"] == 0.0
    mixed = [s for s, r in reference.rows.items() if 0.0 < r["reward/mean"] < 1.0]
    assert len(mixed) >= 2, "parity rewards should vary"
    assert all(reference.rows[s]["grad_norm"] > 0.0 for s in mixed)
    assert trees_differ(reference.init, reference.params)
    with Checkpointer(reference.run_dir / "checkpoints") as c:
        assert c.latest_step() == STEPS
        assert c.all_steps() == [3, 4]  # run.keep_checkpoints = 2
    roll = load_rollouts(reference.run_dir, 1)
    np.testing.assert_array_equal(roll["prompt_ids"],
                                  np.repeat(prompt_schedule(0, 200, 1, PROMPTS), SAMPLES))
    assert roll["rewards"].tolist() == [float(len(r) % 2) for r in
                                        (reference.trainer.tokenizer.decode(t) for t in roll["responses"])]


def test_callback_events_arrive_in_order_with_the_steps_data(reference):
    """``GRPOTrainer(callbacks=[...])``: ``wrap_generate`` once per rollout worker and its wrapper
    on every engine call; ``wrap_submit`` once and its wrapper starting every step's rollout; per step rollout_end, before_update, update_end, step_end with that
    step's number and data (the saved rollouts and rewards, the params the update starts from and
    ends with, the logged metrics row); train_end once after the last checkpoint, before the final
    evaluation, with the built-in Gantt plot already drawn."""
    rec, trainer = reference.recorder, reference.trainer
    assert rec.wrapped == len(trainer.engines) >= 1
    assert rec.generate_calls >= STEPS  # at least one engine call per step's rollout
    assert rec.submit_wraps == 1 and rec.submitted == list(range(1, STEPS + 1))  # sync: one rollout a step
    per_step = ["rollout_end", "before_update", "update_end", "step_end"]
    assert [(e, s) for e, s, _ in rec.events] == (
        [(e, s) for s in range(1, STEPS + 1) for e in per_step] + [("train_end", STEPS)])
    by = {(e, s): d for e, s, d in rec.events}
    before = reference.init
    for step in range(1, STEPS + 1):
        roll, saved = by["rollout_end", step], load_rollouts(reference.run_dir, step)
        assert roll.batch_step == step
        np.testing.assert_array_equal(roll.ids, saved["prompt_ids"])
        np.testing.assert_array_equal(roll.ids, np.repeat(prompt_schedule(0, 200, step, PROMPTS), SAMPLES))
        assert roll.tokens == [r.tolist() for r in saved["responses"]]
        np.testing.assert_array_equal(roll.rewards, saved["rewards"])
        assert by["before_update", step].rows == PER_STEP
        assert_trees_equal(by["before_update", step].params, before)  # sync: the behaviour params
        after = by["update_end", step]
        assert len(after.minibatches) == trainer.cfg.grpo.minibatches
        if 0.0 < reference.rows[step]["reward/mean"] < 1.0:  # a signal: the update moved the params
            assert trees_differ(before, after.params)
        assert by["step_end", step]["grad_norm"] == pytest.approx(
            float(np.mean([m["grad_norm"] for m in after.minibatches])))
        logged = {"step": step, "phase": "train", **by["step_end", step]}  # metrics.jsonl adds step, phase
        assert comparable(logged) == comparable(reference.rows[step])
        before = after.params
    assert_trees_equal(before, reference.params)
    end = by["train_end", STEPS]
    assert end.gantt and end.eval_steps == [0]  # the final evaluation (step 4) comes after


def test_a_callback_must_be_a_trainer_callback(tmp_path):
    with pytest.raises(TypeError, match="TrainerCallback"):
        GRPOTrainer(tiny_cfg(tmp_path), callbacks=[lambda *a: None])
    assert not (tmp_path / "tiny").exists()  # refused before anything is written


def train_steps_by_hand(cfg, steps):
    """Run GRPO ``steps`` with ``train_step`` + ``save`` after each (an interrupted run)."""
    first = GRPOTrainer(cfg, reward_fn=parity_reward)
    try:
        for step in steps:
            m = first.train_step(step)
            first.step = step
            first.metrics.log(step, m, phase="train")
            first.save()
    finally:
        first.close()


def test_resume_after_two_steps_is_bit_identical(reference, tmp_path):
    """Steps 1-2 driven by hand (train_step + save) with grpo.steps=4 (the LR schedule depends on
    it), then a new trainer with resume=True finishes steps 3-4."""
    cfg = tiny_cfg(tmp_path)
    train_steps_by_hand(cfg, (1, 2))

    second = GRPOTrainer(cfg, resume=True, reward_fn=parity_reward)
    try:
        assert second.step == 2
        result = second.fit()
    finally:
        second.close()
    assert result["steps"] == STEPS
    assert_trees_equal(host_copy(second.state), reference.params)
    assert_trees_equal(host_copy(second.opt_state), reference.opt_state)
    rows = train_rows(second.run_dir)
    assert sorted(rows) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert comparable(rows[step]) == comparable(reference.rows[step]), f"step {step}"
    for step in (3, 4):  # the replayed steps sampled exactly the same rollouts
        a, b = load_rollouts(second.run_dir, step), load_rollouts(reference.run_dir, step)
        assert [r.tolist() for r in a["responses"]] == [r.tolist() for r in b["responses"]]
        np.testing.assert_array_equal(a["rewards"], b["rewards"])


def _wait_for_train_row(proc, run_dir: Path, step: int, log: Path, limit_s: float = 600.0) -> None:
    """Poll metrics.jsonl (not the checkpoint dir: a Checkpointer constructed now would clean up
    the live run's in-progress tmp checkpoint). ``limit_s`` only guards against a hang."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"training exited early (rc={proc.returncode}):\n{log.read_text()[-4000:]}")
        if any(r["phase"] == "train" and r["step"] >= step for r in read_metrics(run_dir)):
            return
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"no train row for step {step} after {limit_s} s:\n{log.read_text()[-4000:]}")


def test_sigkill_mid_run_then_resume_matches_uninterrupted_run(reference, compile_cache, tmp_path):
    """``rhyme-jax train`` killed with SIGKILL in step 4 (after step 3 was logged but only step 2
    checkpointed: run.checkpoint_every=2), then ``--resume``d to completion: exit 0, every train
    step logged exactly once, and parameters, optimizer state and per-step metrics bit-identical
    to the uninterrupted in-process run (same programs, same CPU backend, deterministic rollouts
    keyed by (seed, step))."""
    sets = [f"run.runs_dir={tmp_path}", "run.checkpoint_every=2"]
    cmd = [sys.executable, "-c", _BOOT, "train", "--config", str(CONFIG)]
    cmd += [a for s in sets for a in ("--set", s)]
    env = dict(os.environ, **compile_cache)
    run_dir = tmp_path / "tiny"
    log = tmp_path / "killed.log"
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT,
                                env=dict(env, RHYME_TEST_BLOCK_AT_CALL=str(3 * PER_STEP + 1)))
        try:
            _wait_for_train_row(proc, run_dir, 3, log)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    with Checkpointer(run_dir / "checkpoints") as c:
        assert c.latest_step() == 2
    assert sorted(train_rows(run_dir)) == [1, 2, 3]  # step 3 logged, never checkpointed

    done = subprocess.run(cmd + ["--resume"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with Checkpointer(run_dir / "checkpoints") as c:
        assert c.latest_step() == STEPS
    rows = train_rows(run_dir)
    assert sorted(rows) == [1, 2, 3, 4]
    for step in rows:
        assert comparable(rows[step]) == comparable(reference.rows[step]), f"step {step}"
    evals = [r["step"] for r in read_metrics(run_dir) if r["phase"] == "eval"]
    assert evals == [0, STEPS]  # the before-RL eval was restored from the checkpoint, not redone
    params, opt_state, meta = restore(run_dir, STEPS, reference.trainer)
    assert meta["step"] == STEPS and meta["data_position"] == STEPS * PROMPTS
    assert_trees_equal(params, reference.params)
    assert_trees_equal(opt_state, reference.opt_state)


class FaultyReward:
    """``parity_reward`` except NaN on the given 1-based call numbers (``None`` = always)."""

    def __init__(self, nan_calls=None):
        self.nan_calls, self.calls = nan_calls, 0

    def __call__(self, text, problem):
        self.calls += 1
        if self.nan_calls is None or self.calls in self.nan_calls:
            return float("nan")
        return parity_reward(text, problem)


def test_one_nonfinite_step_is_skipped_and_training_goes_on(compile_cache, tmp_path):
    # One NaN sample (the first of step 2) poisons that step's advantages and loss.
    trainer = GRPOTrainer(tiny_cfg(tmp_path, "run.keep_checkpoints=10"),
                          reward_fn=FaultyReward({PER_STEP + 1}))
    try:
        result = trainer.fit()
    finally:
        trainer.close()
    assert result["steps"] == STEPS and result["nonfinite_skipped"] == 1
    rows = train_rows(trainer.run_dir)
    assert [rows[s]["finite"] for s in (1, 2, 3, 4)] == [1.0, 0.0, 1.0, 1.0]
    assert [rows[s]["nonfinite/skipped_total"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    assert math.isnan(rows[2]["loss"]) and math.isfinite(rows[3]["loss"])
    p1, o1, _ = restore(trainer.run_dir, 1, trainer)
    p2, o2, meta2 = restore(trainer.run_dir, 2, trainer)
    p3, _, meta3 = restore(trainer.run_dir, 3, trainer)
    assert_trees_equal(p2, p1)  # the skipped step changed neither params ...
    assert_trees_equal(o2, o1)  # ... nor the optimizer state
    assert trees_differ(p2, p3)  # and the next step trained again
    assert (meta2["nonfinite_total"], meta2["nonfinite_run"]) == (1, 1)
    assert (meta3["nonfinite_total"], meta3["nonfinite_run"]) == (1, 0)


def test_persistent_nonfinite_loss_stops_with_checkpoint_in_message(compile_cache, tmp_path):
    trainer = GRPOTrainer(tiny_cfg(tmp_path, "grpo.max_consecutive_nonfinite=2"),
                          reward_fn=FaultyReward(None))
    init = host_copy(trainer.state)
    try:
        with pytest.raises(NonFiniteLossError) as err:
            trainer.fit()
    finally:
        trainer.close()
    msg = str(err.value)
    assert "2 consecutive" in msg and "step 2" in msg
    assert f"Last good checkpoint: step 1 in {trainer.run_dir / 'checkpoints'}" in msg
    rows = train_rows(trainer.run_dir)
    assert sorted(rows) == [1, 2] and all(r["finite"] == 0.0 for r in rows.values())
    with Checkpointer(trainer.run_dir / "checkpoints") as c:
        assert c.all_steps() == [1]  # step 2 raised before its checkpoint
    params, _, meta = restore(trainer.run_dir, None, trainer)
    assert meta["step"] == 1 and meta["nonfinite_run"] == 1
    assert_trees_equal(params, init)  # nothing non-finite was ever applied


def _step_with_one_overlong_prompt(tokenizer, cfg):
    """A GRPO step whose two prompts differ in length, and the shorter length."""
    train, _ = load_problems(cfg.data)
    for step in range(1, STEPS + 1):
        lens = [len(tokenizer.encode(tokenizer.format_prompt(cfg.model.prompt_template, train[i].question)))
                for i in prompt_schedule(cfg.run.seed, len(train), step, PROMPTS)]
        if lens[0] != lens[1]:
            return step, lens
    pytest.skip("every step's prompts have equal length")


@pytest.mark.parametrize("mode", ["error", "skip"])
def test_overlong_prompt_in_grpo_step(reference, compile_cache, tmp_path, mode):
    """rollout.max_prompt_len below one of a step's two prompts: "error" raises the engine's
    PromptTooLongError; "skip" runs the step with the skipped group at reward 0 (the verifier is
    not asked) and zero loss weight, the other group training normally."""
    tok_file = reference.run_dir / "tokenizer.json"  # reuse the reference's trained tokenizer
    cfg = tiny_cfg(tmp_path, f"model.tokenizer_path={tok_file}")
    step, lens = _step_with_one_overlong_prompt(reference.trainer.tokenizer, cfg)
    limit, long_group = min(lens), int(np.argmax(lens))
    rf = FaultyReward(set())
    trainer = GRPOTrainer(tiny_cfg(tmp_path, f"model.tokenizer_path={tok_file}",
                                   f"rollout.max_prompt_len={limit}",
                                   f"rollout.on_overlong_prompt={mode}"), reward_fn=rf)
    try:
        before = host_copy(trainer.state)
        if mode == "error":
            with pytest.raises(PromptTooLongError, match=f"{max(lens)} tokens, more than max_prompt_len={limit}"):
                trainer.train_step(step)
            return
        m = trainer.train_step(step)
    finally:
        trainer.close()
    assert m["finite"] == 1.0 and m["rollout/skipped"] == SAMPLES
    assert rf.calls == SAMPLES  # only the kept group reached the verifier
    roll = load_rollouts(trainer.run_dir, step)
    skipped = np.arange(PER_STEP) // SAMPLES == long_group
    assert (roll["lengths"][skipped] == 0).all() and (roll["lengths"][~skipped] > 0).all()
    assert (roll["rewards"][skipped] == 0.0).all()
    kept_rewards = roll["rewards"][~skipped]
    assert kept_rewards.tolist() == [float(len(reference.trainer.tokenizer.decode(t)) % 2)
                                     for t, k in zip(roll["responses"], ~skipped) if k]
    # The skipped group contributes nothing: the update is driven by the kept group alone.
    if 0.0 < kept_rewards.mean() < 1.0:  # (on the CPU backend: rewards 0, 1, 0, 1)
        assert m["grad_norm"] > 0.0 and trees_differ(before, host_copy(trainer.state))
    else:
        assert m["grad_norm"] == 0.0 and not trees_differ(before, host_copy(trainer.state))


@pytest.mark.parametrize("bad_line, why", [
    ('{"question": "Ann has 3 cats. How many?", "answer": "3"}', "no '#### <final answer>' marker"),
    ('{"question": "Ann has 3 cats.", "answer": ', "invalid JSON"),
], ids=["no-final-answer", "invalid-json"])
def test_malformed_gsm8k_line_fails_naming_file_and_line(tmp_path, bad_line, why):
    good = '{"question": "Ann has 3 cats and gets 2 more. How many?", "answer": "3 + 2 = 5\\n#### 5"}'
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join([good, good, bad_line, good]) + "\n")
    test = tmp_path / "test.jsonl"
    test.write_text(good + "\n")
    cfg = tiny_cfg(tmp_path / "runs", "data.source=gsm8k", f"data.train_path={train}",
                   f"data.test_path={test}")
    with pytest.raises(DataError) as err:
        GRPOTrainer(cfg, reward_fn=parity_reward)
    assert str(err.value).startswith(f"{train}:3:")
    assert why in str(err.value)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # no half-made run


def test_padding_free_step_trains_like_the_padded_one(reference, compile_cache, tmp_path, monkeypatch):
    """``grpo.padding_free``: step 1 (same weights, so the same rollouts) gives the reference
    run's update on fewer token slots; loss and gradient norm agree within the bound of
    tests/test_packing.py: twice the float32 forward bound of the model's reduction path,
    doubled for two programs (``f32.between_programs(2 f32.forward(widths, 1))``, 2.3e-4
    relative for tiny_test's model at 64 tokens); a wrong mask or position changes them by
    percent."""
    from rhyme_jax.train import length_classes  # the trainer packs through length_classes.update_calls
    packed, pack = [], length_classes.pack_minibatch

    def spy(batch, loss_agg, **kw):
        out = pack(batch, loss_agg, **kw)
        carries = batch["loss_mask"].sum(axis=1) > 0  # rows without loss tokens stay out (train/packing.py)
        packed.append((int(batch["attn_mask"][carries].sum()), int(out["attn_mask"].sum()), out["segment_ids"].max()))
        return out

    monkeypatch.setattr(length_classes, "pack_minibatch", spy)
    trainer = GRPOTrainer(tiny_cfg(tmp_path, "grpo.padding_free=true", "grpo.steps=1"),
                          reward_fn=parity_reward)
    try:
        trainer.fit()
    finally:
        trainer.close()
    got, ref = train_rows(trainer.run_dir)[1], reference.rows[1]
    assert got["reward/mean"] == ref["reward/mean"] and got["response_length/mean"] == ref["response_length/mean"]
    assert packed and all(a == b for a, b, _ in packed)  # every minibatch packed, no token of a loss row lost
    assert got["update/grid_tokens"] <= ref["update/grid_tokens"]
    m = trainer.cfg.model.tiny
    rel = f32.between_programs(2 * f32.forward(f32.decoder_widths(
        m.num_layers, m.hidden_size, m.intermediate_size, m.num_heads, m.head_dim, 64), 1.0))
    for k in ("loss", "grad_norm", "entropy"):
        assert abs(got[k] - ref[k]) <= rel * max(abs(ref[k]), 1e-3), (k, got[k], ref[k])
