"""Both sides of ``python -m benchmarks.trl_side_by_side``: the rhyme-jax run (``rhyme-jax train``
in a subprocess, or a finished run read back) and TRL's ``GRPOTrainer`` on the same prompt
schedule, timed per generation and per optimizer step. trl, transformers, torch and datasets are
imported only inside the functions that use them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from rhyme_lab.bench.trl_mapping import (SideBySideError, expected_prompt_ids, our_eos, schedule_rows, trl_model_dir,
                                         trl_settings)
from rhyme_jax.config import load_config
from rhyme_jax.data import load_problems
from rhyme_jax.data.rewards import reward_fn as reward_fn_of
from rhyme_jax.io.metrics import read_metrics
from rhyme_jax.io.rollout_log import load_rollouts


def rhyme_run_dir(cfg) -> Path:
    """``<run.runs_dir>/<run.name>``."""
    return Path(cfg.run.runs_dir) / cfg.run.name

def is_finished(run_dir: Path, cfg) -> bool:
    """Whether ``run_dir`` holds a finished rhyme-jax run of exactly ``cfg``."""
    summary, saved = run_dir / "summary.json", run_dir / "config.yaml"
    if not (summary.is_file() and saved.is_file()):
        return False
    done = json.loads(summary.read_text()).get("steps") == cfg.grpo.steps
    return done and load_config(saved) == cfg

def run_rhyme(config: str, overrides: list[str], cfg) -> Path:
    """Run ``rhyme-jax train`` with ``config`` + ``overrides`` (those of ``cfg``: seed, name) in a
    subprocess, unless that run is already finished. Returns its run directory.

    Raises:
      RuntimeError: the training command failed.
    """
    run_dir = rhyme_run_dir(cfg)
    if is_finished(run_dir, cfg):
        print(f"rhyme-jax: reusing the finished run {run_dir}", flush=True)
        return run_dir
    cmd = [sys.executable, "-m", "rhyme_jax.cli", "train", "--config", str(config)]
    for item in overrides + [f"run.seed={cfg.run.seed}", f"run.name={cfg.run.name}"]:
        cmd += ["--set", item]
    print("rhyme-jax:", " ".join(cmd[2:]), flush=True)
    rc = subprocess.call(cmd)
    if rc != 0:
        raise RuntimeError(f"rhyme-jax train exited with {rc} (its error is printed above; an unfinished run "
                           f"already at {run_dir}? then pass --rhyme-run-dir or --set run.name=...)")
    return run_dir

def wait_for_summary(run_dir: Path, minutes: float) -> None:
    """Poll (every 20 s, up to ``minutes``) until ``run_dir/summary.json`` exists: a run started
    beside this one has finished. Returns at once when it exists or ``minutes`` is 0."""
    deadline = time.time() + 60 * minutes
    while not (Path(run_dir) / "summary.json").is_file() and time.time() < deadline:
        print(f"waiting for {run_dir} to finish ...", flush=True)
        time.sleep(20)

def read_rhyme(run_dir: Path, cfg, eval_step: int | None = None) -> dict:
    """Per-step rewards, seconds and prompts of the first ``grpo.steps`` steps of a finished
    rhyme-jax run, and its held-out results before and after ``eval_step`` steps (default
    ``grpo.steps``).

    Raises:
      RuntimeError: a training step or an evaluation is missing.
    """
    from rhyme_jax.io.summary import eval_path

    rows = read_metrics(run_dir)
    train = {int(r["step"]): r for r in rows if r.get("phase") == "train"}
    steps = list(range(1, cfg.grpo.steps + 1))
    if any(s not in train for s in steps):
        raise RuntimeError(f"{run_dir}: metrics.jsonl lacks train steps {[s for s in steps if s not in train]}")
    ends = [eval_path(run_dir, 0), eval_path(run_dir, eval_step or cfg.grpo.steps)]
    if not all(p.is_file() for p in ends):
        raise RuntimeError(f"{run_dir}: missing held-out results {[str(p) for p in ends if not p.is_file()]}")
    before, after = (np.load(p)["correct"].astype(np.float64) for p in ends)
    saved = [load_rollouts(run_dir, s) for s in steps]
    return {
        "reward_mean": [float(train[s]["reward/mean"]) for s in steps],
        "rewards": [r["rewards"].astype(float).tolist() for r in saved],
        "rollout_s": [float(train[s]["time/rollout_s"]) for s in steps],
        "update_s": [float(train[s]["time/train_s"]) for s in steps],
        "prompt_ids": [r["prompt_ids"].astype(int).tolist() for r in saved],
        "eval_before": before, "eval_after": after,
    }

def build_dataset(cfg, train_problems, ours):
    """The TRL train dataset: one row per scheduled prompt, step after step (columns ``prompt``:
    the question in the run's prompt format via our tokenizer's ``format_prompt``,
    ``problem_index``, ``grpo_step``)."""
    from datasets import Dataset

    rows = schedule_rows(cfg, len(train_problems))
    return Dataset.from_dict({
        "prompt": [ours.format_prompt(cfg.model.prompt_template, train_problems[i].question) for _, i in rows],
        "problem_index": [i for _, i in rows], "grpo_step": [s for s, _ in rows]})

def prompt_token_check(cfg, dataset, hf_tok, ours) -> dict:
    """Whether TRL's tokenisation of every scheduled prompt equals ours (``ours.encode``), and how
    many prompts exceed ``rollout.max_prompt_len``."""
    texts = sorted(set(dataset["prompt"]))
    theirs = hf_tok(text=texts)["input_ids"]
    mine = [ours.encode(t) for t in texts]
    return {"identical": all(list(a) == list(b) for a, b in zip(theirs, mine)),
            "overlong": sum(len(m) > cfg.rollout.max_prompt_len for m in mine), "unique_prompts": len(texts)}

class Recorder:
    """What the TRL run did per generation (= GRPO step) and per optimizer step."""

    def __init__(self):
        self.gen_s, self.reward_s, self.steps, self.spans, self.logs = [], [], [], [], []
        self._t0 = 0.0

    def callback(self):
        """A ``TrainerCallback`` timing each optimizer step and keeping TRL's logs."""
        from transformers import TrainerCallback

        rec = self

        class _Clock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                rec._t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                rec.spans.append(time.perf_counter() - rec._t0)

            def on_log(self, args, state, control, logs=None, **kw):
                rec.logs.append({"step": state.global_step, **{k: v for k, v in (logs or {}).items()
                                                               if isinstance(v, (int, float))}})
        return _Clock()

    def time_generation(self, trainer) -> None:
        """Wrap ``trainer._generate`` (TRL 1.x: tokenise, generate, decode one generation batch)."""
        inner = trainer._generate

        def timed(prompts):
            t0 = time.perf_counter()
            out = inner(prompts)
            self.gen_s.append(time.perf_counter() - t0)
            return out
        trainer._generate = timed

    def reward_function(self, cfg, train_problems):
        """TRL reward function: the run's task reward; records each generation batch's prompts."""
        score = reward_fn_of(cfg.data.answer_extraction)

        def task_reward(prompts, completions, completion_ids, problem_index, grpo_step, **_):
            t0 = time.perf_counter()
            rewards = [float(score(c, train_problems[int(i)])) for c, i in zip(completions, problem_index)]
            self.steps.append({"prompt_ids": [int(i) for i in problem_index], "grpo_step": sorted(set(grpo_step)),
                               "rewards": rewards, "lengths": [len(c) for c in completion_ids]})
            self.reward_s.append(time.perf_counter() - t0)
            return rewards
        return task_reward

def greedy_correct(model, tok, texts, problems, cfg, eos_ids, batch: int) -> np.ndarray:
    """Per-problem 0/1 greedy correctness of a transformers model on prompt ``texts`` (batched, left
    padding, the run's EOS ids, ``rollout.max_new_tokens`` and task reward)."""
    import torch

    score = reward_fn_of(cfg.data.answer_extraction)
    was_training, out = model.training, []
    model.eval()
    with torch.no_grad():
        for i in range(0, len(texts), batch):
            enc = tok(text=texts[i:i + batch], return_tensors="pt", padding=True).to(model.device)
            gen = model.generate(**enc, do_sample=False, max_new_tokens=cfg.rollout.max_new_tokens,
                                 eos_token_id=list(eos_ids), pad_token_id=tok.pad_token_id,
                                 temperature=None, top_p=None, top_k=None)
            for row, prob in zip(gen[:, enc["input_ids"].shape[1]:].tolist(), problems[i:i + batch]):
                cut = next((k for k, t in enumerate(row) if t in eos_ids), len(row))
                out.append(score(tok.decode(row[:cut], skip_special_tokens=True), prob))
    model.train(was_training)
    return np.asarray(out, np.float64)

def run_trl(cfg, out_dir: Path, *, attn: str, cpu: bool, eval_batch: int) -> dict:
    """Train with TRL's ``GRPOTrainer`` on the run's schedule and score it before and after.

    Raises:
      SideBySideError: ``model.path`` is empty (TRL needs a HF checkpoint directory or a known name).
    """
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rhyme_jax.model import hub
    from rhyme_jax.model.tokenizer import Tokenizer
    from rhyme_jax.train.policy import select_chat_template, tokenizer_file

    if not cfg.model.path:
        raise SideBySideError("model.path is empty (the demo model): TRL needs a HF checkpoint directory or a known "
                         "model name")
    path = str(hub.ensure(cfg.model.path))
    train, held_out = load_problems(cfg.data)
    tok_file = tokenizer_file(cfg, out_dir)
    ours = Tokenizer.from_file(tok_file).use_chat_template(select_chat_template(cfg, tok_file.parent),
                                                           cfg.model.system_prompt)
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    dataset = build_dataset(cfg, train, ours)
    tokens = prompt_token_check(cfg, dataset, tok, ours)
    eval_texts = [ours.format_prompt(cfg.model.prompt_template, p.question) for p in held_out]
    rec = Recorder()
    settings = trl_settings(cfg, attn=attn, cpu=cpu)
    trainer = GRPOTrainer(model=trl_model_dir(path, out_dir), reward_funcs=rec.reward_function(cfg, train),
                          args=GRPOConfig(output_dir=str(out_dir), **settings), train_dataset=dataset,
                          processing_class=tok, callbacks=[rec.callback()])
    rec.time_generation(trainer)
    tokens.update(eos_trl=sorted(int(i) for i in trainer.eos_token_ids), eos_ours=our_eos(path, ours))
    t0 = time.perf_counter()
    before = greedy_correct(trainer.model, tok, eval_texts, held_out, cfg, trainer.eos_token_ids, eval_batch)
    t1 = time.perf_counter()
    trainer.train()
    t2 = time.perf_counter()
    after = greedy_correct(trainer.model, tok, eval_texts, held_out, cfg, trainer.eos_token_ids, eval_batch)
    return {"settings": settings, "tokens": tokens, "recorder": rec,
            "expected_prompt_ids": expected_prompt_ids(cfg, len(train)), "eval_before": before, "eval_after": after,
            "eval_s": t1 - t0 + time.perf_counter() - t2, "train_wall_s": t2 - t1}

def trl_steps(rec: Recorder, minibatches: int) -> dict:
    """Per-GRPO-step rewards, seconds and prompts of a TRL run (``minibatches`` optimizer steps per
    generation)."""
    n = len(rec.steps)
    wall = [float(sum(rec.spans[k * minibatches:(k + 1) * minibatches])) for k in range(n)]
    return {
        "reward_mean": [float(np.mean(s["rewards"])) for s in rec.steps],
        "rewards": [s["rewards"] for s in rec.steps],
        "rollout_s": [float(x) for x in rec.gen_s[:n]],
        "reward_s": [float(x) for x in rec.reward_s[:n]],
        "update_s": [w - g - r for w, g, r in zip(wall, rec.gen_s, rec.reward_s)],
        "step_wall_s": wall,
        "prompt_ids": [s["prompt_ids"] for s in rec.steps],
        "grpo_step_column": [s["grpo_step"] for s in rec.steps],
        "mean_length": [float(np.mean(s["lengths"])) for s in rec.steps],
    }
