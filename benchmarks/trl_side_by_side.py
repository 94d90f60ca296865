"""TRL's ``GRPOTrainer`` on the same run as a rhyme-jax config, side by side (issue 31, item 2).

For each seed, the rhyme-jax run (``rhyme-jax train`` with the config, or a finished run named by
``--rhyme-run-dir``) and a TRL 1.x ``GRPOTrainer`` run with the settings mapped from the same config
(docs/trl_mapping.md):

* the same prompts in the same order: the TRL dataset is the rhyme-jax prompt schedule
  (``train/prompts.py``: ``prompt_schedule`` over ``num_grpo_prompts``) laid out step after step,
  with TRL's shuffling off (``shuffle_dataset=False``; its ``RepeatSampler`` then walks the dataset
  in order, ``grpo.prompts_per_step`` prompts x ``grpo.samples_per_prompt`` generations per
  generation batch). Each TRL generation batch's prompts are recorded and compared with the
  rhyme-jax run's ``rollouts/step_*.npz`` ``prompt_ids``;
* one generation per GRPO step, split into ``grpo.minibatches`` optimizer steps
  (``steps_per_generation = grpo.minibatches``, ``gradient_accumulation_steps = 1``,
  ``max_steps = grpo.steps x grpo.minibatches``, the schedule counted in optimizer steps as ours);
* the same reward (``data.rewards.reward_fn(data.answer_extraction)``) and held-out problems: TRL's
  policy is scored greedily before and after with batched, left-padded transformers ``generate``
  (same prompts, EOS ids and ``rollout.max_new_tokens``), next to the rhyme-jax run's own
  evaluations (``eval/step_*.npz``), each with its paired gain and standard error.

Per TRL step it times the rollout (the trainer's ``_generate``: tokenise, ``generate``, decode) and
the update (the optimizer steps' wall time minus rollout and reward; it includes TRL's log-prob
forward passes). Writes ``OUT/report.md``, ``OUT/report.json`` and ``OUT/rewards.png``.

    python benchmarks/trl_side_by_side.py --config configs/arith_smollm2_135m.yaml --seeds 0,1
    python benchmarks/trl_side_by_side.py --rhyme-run-dir runs/arith_smollm2_135m   # a finished run

TRL runs on CPU in float32 (``bf16`` autocast when ``model.dtype=bfloat16``), without vLLM. What TRL
cannot match is listed in the report (``unmatched``), with the reason.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from rhyme_jax.config import load_config
from rhyme_jax.data import load_problems
from rhyme_jax.data.rewards import reward_fn as reward_fn_of
from rhyme_jax.io.rollout_log import load_rollouts
from rhyme_jax.train.evaluate import paired_gain
from rhyme_jax.train.metrics import read_metrics
from rhyme_jax.train.optim import make_optimizer
from rhyme_jax.train.prompts import num_grpo_prompts, prompt_schedule

# grpo.loss_agg -> TRL loss_type (docs/trl_mapping.md, "Key mapping")
LOSS_TYPES = {"token_mean": "bnpo", "seq_mean_token_mean": "grpo", "seq_mean_token_sum_norm": "dr_grpo",
              "step_token_mean": "dapo"}
SCHEDULES = {"constant": "constant_with_warmup", "cosine": "cosine"}


# ---------------------------------------------------------------------------------- configs
def parse_args(argv=None) -> argparse.Namespace:
    """Command-line arguments (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/arith_smollm2_135m.yaml", help="rhyme-jax run config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for both sides (repeatable)")
    p.add_argument("--seeds", default="0", help="comma-separated run.seed values (default: %(default)s)")
    p.add_argument("--rhyme-run-dir", action="append", default=[], metavar="DIR",
                   help="finished rhyme-jax run(s) to compare with (repeatable or comma-separated); the TRL "
                        "run takes each one's config.yaml and seed, and --config/--set/--seeds are ignored")
    p.add_argument("--out", default="results/trl_side_by_side", help="report directory")
    p.add_argument("--window", type=int, default=0,
                   help="final-window length in GRPO steps (0 = max(1, grpo.steps // 4))")
    p.add_argument("--eval-batch", type=int, default=64, help="rows per greedy generate call (TRL eval)")
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="TRL attention implementation")
    p.add_argument("--trl-device", default="cpu", choices=("cpu", "auto"),
                   help="cpu (default) or accelerate's default device")
    p.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    p.add_argument("--merge", default="", metavar="DIRS",
                   help="comma-separated report directories of earlier runs of this script (one seed each, "
                        "run side by side): write their combined report under --out; nothing is trained")
    p.add_argument("--wait-minutes", type=float, default=0,
                   help="with --rhyme-run-dir: wait up to this long for a named run still training to finish "
                        "(its summary.json) before comparing it")
    p.add_argument("--steps", type=int, default=0,
                   help="with --rhyme-run-dir: compare the first N GRPO steps (TRL trains N; the rhyme-jax "
                        "side is its run's first N steps, the same run's beginning under a constant schedule "
                        "without warm-up; its held-out 'after' stays at the end of its run). 0 = all steps")
    return p.parse_args(argv)


def seed_runs(args) -> list[dict]:
    """``[{seed, cfg, rhyme_dir}]``: one per ``--seeds`` value (``rhyme_dir`` None: to be run), or
    one per ``--rhyme-run-dir`` (its config.yaml, its seed).

    Raises:
      SystemExit: a named run directory has no config.yaml, or --set is combined with it.
    """
    dirs = [d for item in args.rhyme_run_dir for d in item.split(",") if d.strip()]
    if dirs:
        if args.overrides:
            raise SystemExit("--set with --rhyme-run-dir: the TRL run takes each rhyme-jax run's own config")
        out = []
        for d in dirs:
            if not (Path(d) / "config.yaml").is_file():
                raise SystemExit(f"--rhyme-run-dir {d}: no config.yaml (not a rhyme-jax run directory)")
            full = load_config(Path(d) / "config.yaml")
            cfg = truncated(full, args.steps, d)
            out.append({"seed": int(cfg.run.seed), "cfg": cfg, "rhyme_dir": Path(d), "eval_step": full.grpo.steps})
        return out
    if args.steps:
        raise SystemExit("--steps needs --rhyme-run-dir (a finished run whose first steps are compared)")
    base = load_config(args.config, args.overrides)
    seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    return [{"seed": s, "cfg": load_config(args.config, args.overrides + [
        f"run.seed={s}", f"run.name={base.run.name}_s{s}"]), "rhyme_dir": None} for s in seeds]


def adam_defaults() -> dict:
    """b1, b2, eps of rhyme-jax's AdamW (``train/optim.make_optimizer``'s defaults)."""
    params = inspect.signature(make_optimizer).parameters
    return {k: params[k].default for k in ("b1", "b2", "eps")}


def scale_rewards(g) -> str:
    """``grpo.scale_rewards`` (``group`` / ``batch`` / ``none``), from the older ``scale_by_std`` too."""
    value = getattr(g, "scale_rewards", None)
    if value is None:
        value = "group" if getattr(g, "scale_by_std", True) else "none"
    return str(value)


def trl_settings(cfg, *, attn: str = "sdpa", cpu: bool = True) -> dict:
    """``GRPOConfig`` keyword arguments mapped from a rhyme-jax config (docs/trl_mapping.md), minus
    ``output_dir``. One generation per GRPO step, ``grpo.minibatches`` optimizer steps each."""
    g, r = cfg.grpo, cfg.rollout
    rows, mb = g.prompts_per_step * g.samples_per_prompt, g.minibatches
    adam = adam_defaults()
    return dict(
        num_generations=g.samples_per_prompt, per_device_train_batch_size=rows // mb, steps_per_generation=mb,
        gradient_accumulation_steps=1, num_iterations=1, max_steps=g.steps * mb, shuffle_dataset=False,
        learning_rate=g.learning_rate, lr_scheduler_type=SCHEDULES[g.schedule], warmup_steps=g.warmup_steps * mb,
        weight_decay=g.weight_decay, max_grad_norm=g.max_grad_norm, optim="adamw_torch",
        adam_beta1=adam["b1"], adam_beta2=adam["b2"], adam_epsilon=adam["eps"],
        epsilon=g.eps_low, epsilon_high=g.eps_high, beta=g.kl_coef, use_bias_correction_kl=False,
        loss_type=LOSS_TYPES[g.loss_agg], scale_rewards=scale_rewards(g),
        temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, max_completion_length=r.max_new_tokens,
        seed=int(cfg.run.seed), data_seed=int(cfg.run.seed), gradient_checkpointing=bool(g.remat),
        bf16=cfg.model.dtype == "bfloat16", fp16=False, use_cpu=cpu, use_vllm=False, disable_dropout=True,
        model_init_kwargs={"dtype": "float32", "attn_implementation": attn},
        report_to=[], logging_steps=1, save_strategy="no", log_completions=False, dataloader_pin_memory=False,
        remove_unused_columns=False,
    )


def unmatched(cfg, *, starts_from_sft: bool, overlong: int) -> list[dict]:
    """Settings of the rhyme-jax run that TRL 1.x cannot reproduce, each with the reason."""
    g, out = cfg.grpo, []

    def add(setting: str, why: str):
        out.append({"setting": setting, "why": why})

    if cfg.spec.enabled:
        add("spec.* (HistoSpec drafting, window=%s)" % cfg.spec.window,
            "speculative drafts from earlier rollouts verified by the policy; lossless (the tokens keep the "
            "sampling distribution), so it changes rollout seconds only. TRL's generation here is plain "
            "transformers `generate`, which has no drafting")
    add("rollout engine (paged KV pool, continuous batching: rollout.max_slots, page_size, num_pages, "
        "share_prompt_prefix, attention_impl, max_verify_tokens)",
        "engine internals with no TRL knob; TRL pads the generation batch and calls `generate` once")
    add("rollout.max_prompt_len / on_overlong_prompt", "TRL 1.x does not cap prompts; "
        f"{overlong} scheduled prompt(s) exceed max_prompt_len={cfg.rollout.max_prompt_len}")
    add("sampling random numbers", "JAX keys vs torch's generator: the same run.seed does not draw the same "
        "completions, so the curves are compared as samples (means, standard errors), not token by token")
    add("behaviour log-probs", "recorded by the rollout engine on our side; TRL recomputes them with a "
        "training forward pass (steps_per_generation > 1) or takes the detached current ones: the same "
        "quantity up to float rounding, on TRL's update clock")
    if g.minibatches > 1:
        add(f"grpo.minibatches={g.minibatches} (row assignment)", "TRL shuffles the rows of a generation "
            "(`shuffle_sequence_dict`, not configurable) before cutting it into steps_per_generation slices; "
            "our minibatches are consecutive groups. Same number of rows per optimizer step")
    add("grpo.micro_batch_tokens / logit_chunk", "memory only (the loss does not depend on the split); TRL "
        "runs each slice in one pass (gradient_accumulation_steps=1)")
    add("grpo.max_consecutive_nonfinite", "we skip updates with a non-finite loss or gradient; the HF "
        "Trainer applies them")
    if cfg.sched.pipeline != "sync" or cfg.sched.mode != "fifo":
        add(f"sched.pipeline={cfg.sched.pipeline}, sched.mode={cfg.sched.mode}",
            "TRL without vLLM is synchronous on one generation worker: no staleness-1 rollouts or HistoPipe")
    if cfg.run.eval_samples:
        add("run.eval_samples (mean@k)", "only greedy accuracy is measured on the TRL side")
    if cfg.model.dtype == "bfloat16":
        add("model.dtype=bfloat16", "TRL uses bf16 autocast over float32 weights; we cast inside each layer")
    if starts_from_sft:
        add("starting weights", "the rhyme-jax run starts from an SFT warm start / run.init_from; TRL starts "
            "from model.path, so the two runs do NOT start from the same policy")
    add("held-out evaluation engine", "ours: the paged JAX engine; TRL's policy: batched left-padded "
        "transformers `generate`. Same problems, prompt tokens, EOS, max tokens and reward; float "
        "rounding can flip greedy near-ties (`before_agreement` in the report)")
    return out


# ---------------------------------------------------------------------------------- rhyme-jax side
def truncated(cfg, steps: int, where: str):
    """``cfg`` with ``grpo.steps = steps`` (0: unchanged), allowed only where a run of ``steps``
    steps is the longer run's beginning: a constant learning rate without warm-up.

    Raises:
      SystemExit: ``steps`` out of range, or a schedule under which the runs would differ.
    """
    if not steps:
        return cfg
    g = cfg.grpo
    if not 1 <= steps <= g.steps:
        raise SystemExit(f"--steps {steps}: must be in [1, {g.steps}] (the steps of {where})")
    if g.schedule != "constant" or g.warmup_steps:
        raise SystemExit(f"--steps: {where} uses grpo.schedule={g.schedule}, warmup_steps={g.warmup_steps}; its "
                         "first steps are a shorter run's only under a constant rate without warm-up")
    import dataclasses

    return dataclasses.replace(cfg, grpo=dataclasses.replace(g, steps=steps))


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


def read_rhyme(run_dir: Path, cfg, eval_step: int | None = None) -> dict:
    """Per-step rewards, seconds and prompts of the first ``grpo.steps`` steps of a finished
    rhyme-jax run, and its held-out results before and after ``eval_step`` steps (default
    ``grpo.steps``).

    Raises:
      RuntimeError: a training step or an evaluation is missing.
    """
    from rhyme_jax.train.trainer import eval_path

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


# ---------------------------------------------------------------------------------- TRL side
def schedule_rows(cfg, num_train: int) -> list[tuple[int, int]]:
    """``(GRPO step, train problem index)`` of every prompt the run uses, in rhyme-jax's order."""
    g = cfg.grpo
    n_prompts = num_grpo_prompts(cfg, num_train)
    return [(s, int(i)) for s in range(1, g.steps + 1)
            for i in prompt_schedule(cfg.run.seed, n_prompts, s, g.prompts_per_step)]


def expected_prompt_ids(cfg, num_train: int) -> list[list[int]]:
    """Per GRPO step, the problem index of each of its rows (each prompt ``samples_per_prompt``
    times in a row): what both trainers must see."""
    n, out = cfg.grpo.samples_per_prompt, {}
    for s, i in schedule_rows(cfg, num_train):
        out.setdefault(s, []).extend([i] * n)
    return [out[s] for s in sorted(out)]


def build_dataset(cfg, train_problems, ours):
    """The TRL train dataset: one row per scheduled prompt, step after step (columns ``prompt``:
    the question in ``model.prompt_template`` via our tokenizer's ``format_prompt``,
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


def trl_model_dir(path: str, out_dir: Path) -> str:
    """A checkpoint directory TRL 1.x can load: ``path`` itself when its config.json names the model
    class (``architectures``), else ``out_dir/model``: links to ``path``'s files and a config.json
    with ``architectures`` added (TRL's ``create_model_from_path`` reads it, for the policy and the
    KL reference; checkpoints imported from GGUF, e.g. ``smollm2-135m-instruct``, have none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    src = Path(path).resolve()
    config = json.loads((src / "config.json").read_text())
    if config.get("architectures"):
        return str(src)
    view = Path(out_dir) / "model"
    view.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        link = view / f.name
        if f.name != "config.json" and not link.exists():
            link.symlink_to(f)
    config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]
    (view / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return str(view)


def our_eos(path: str, ours) -> list[int]:
    """The ids that end a rhyme-jax response (``policy.eos_ids``): the tokenizer's EOS plus the
    checkpoint's ``eos_token_id``."""
    declared = json.loads((Path(path) / "config.json").read_text()).get("eos_token_id")
    declared = [] if declared is None else declared if isinstance(declared, list) else [declared]
    return sorted({int(ours.eos_id), *(int(i) for i in declared)})


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
    """Train with TRL's ``GRPOTrainer`` on the run's schedule and score it before and after."""
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rhyme_jax.model import hub
    from rhyme_jax.model.tokenizer import Tokenizer
    from rhyme_jax.train.policy import tokenizer_file

    if not cfg.model.path:
        raise SystemExit("model.path is empty (the demo model): TRL needs a HF checkpoint directory or a known "
                         "model name")
    path = str(hub.ensure(cfg.model.path))
    train, held_out = load_problems(cfg.data)
    ours = Tokenizer.from_file(tokenizer_file(cfg, out_dir))
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


# ---------------------------------------------------------------------------------- statistics
def mean_se(units) -> tuple[float, float]:
    """Mean and standard error (ddof 1; 0 for a single unit) of ``units``."""
    x = np.asarray(units, np.float64)
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else 0.0


def window_stats(rhyme_units, trl_units) -> dict:
    """Final-window reward means ± SE of both sides and their difference in SEs
    (``(rhyme - trl) / sqrt(se_r^2 + se_t^2)``)."""
    (mr, sr), (mt, st) = mean_se(rhyme_units), mean_se(trl_units)
    se = math.hypot(sr, st)
    return {"rhyme": {"mean": mr, "se": sr, "units": len(rhyme_units)},
            "trl": {"mean": mt, "se": st, "units": len(trl_units)},
            "difference": mr - mt, "difference_se": se, "difference_in_se": (mr - mt) / se if se > 0 else None}


def window_units(side: dict, window: int) -> list[float]:
    """The units of a final-window mean: per-step reward means over the window's steps, or the
    per-rollout rewards when the window is a single step."""
    if window > 1:
        return side["reward_mean"][-window:]
    return list(side["rewards"][-1])


def seconds_per_step(side: dict) -> dict:
    """Mean rollout, update and total seconds per step, over all steps and over steps >= 2 (after
    rhyme-jax's compiles and TRL's first-call warm-up)."""
    def stats(sl):
        ro, up = np.asarray(side["rollout_s"][sl]), np.asarray(side["update_s"][sl])
        return {"rollout_s": float(ro.mean()), "update_s": float(up.mean()), "total_s": float((ro + up).mean())}
    n = len(side["rollout_s"])
    return {"all": stats(slice(0, n)), "steady": stats(slice(1, n)) if n > 1 else None}


def eval_stats(before: np.ndarray, after: np.ndarray) -> dict:
    """Held-out greedy accuracy before / after and the paired gain ± SE."""
    gain, se = paired_gain(before, after)
    return {"before": float(before.mean()), "after": float(after.mean()), "n": int(before.size),
            "gain": gain, "gain_se": se}


def compare_seed(seed: int, cfg, rhyme: dict, trl: dict, trl_run: dict, rhyme_dir: Path, window: int) -> dict:
    """One seed's side-by-side record (report.json ``runs[i]``)."""
    g = cfg.grpo
    expected = trl_run["expected_prompt_ids"]
    same_order = trl["prompt_ids"] == rhyme["prompt_ids"]
    steps_ok = trl["grpo_step_column"] == [[s] for s in range(1, g.steps + 1)]
    rows = g.prompts_per_step * g.samples_per_prompt
    sec_r, sec_t = seconds_per_step(rhyme), seconds_per_step(trl)
    ratio = {k: (sec_r[k]["total_s"] / sec_t[k]["total_s"]) if sec_r[k] and sec_t[k]["total_s"] > 0 else None
             for k in ("all", "steady")}
    return {
        "seed": seed, "rhyme_run_dir": str(rhyme_dir), "steps": g.steps, "rows_per_step": rows,
        "prompts": {"same_order": bool(same_order and steps_ok), "matches_schedule": trl["prompt_ids"] == expected,
                    "trl_rows_per_step": [len(p) for p in trl["prompt_ids"]], "tokens": trl_run["tokens"]},
        "rhyme": {k: rhyme[k] for k in ("reward_mean", "rollout_s", "update_s")},
        "trl": {**{k: trl[k] for k in ("reward_mean", "rollout_s", "update_s", "reward_s", "step_wall_s",
                                       "mean_length", "prompt_ids")},
                "optimizer_steps": len(trl_run["recorder"].spans)},
        "eval": {"rhyme": eval_stats(rhyme["eval_before"], rhyme["eval_after"]),
                 "trl": eval_stats(trl_run["eval_before"], trl_run["eval_after"]),
                 "before_agreement": float(np.mean(rhyme["eval_before"] == trl_run["eval_before"]))},
        "final_window": dict(window_stats(window_units(rhyme, window), window_units(trl, window)),
                             steps=[g.steps - window + 1, g.steps]),
        "seconds_per_step": {"rhyme": sec_r, "trl": sec_t, "ratio_rhyme_over_trl": ratio},
        "trl_train_wall_s": trl_run["train_wall_s"], "trl_eval_s": trl_run["eval_s"],
        "trl_logs": trl_run["recorder"].logs,
    }


# ---------------------------------------------------------------------------------- report
def summarize(runs: list[dict], window: int) -> dict:
    """Across seeds: the final-window means ± SE (units pooled over seeds) and seconds per step."""
    units = {side: [u for r in runs for u in r["_units"][side]] for side in ("rhyme", "trl")}
    ratios = {k: [r["seconds_per_step"]["ratio_rhyme_over_trl"][k] for r in runs] for k in ("all", "steady")}
    return {
        "final_window": dict(window_stats(units["rhyme"], units["trl"]), window_steps=window),
        "ratio_rhyme_over_trl": {k: float(np.mean(v)) if all(x is not None for x in v) else None
                                 for k, v in ratios.items()},
        "eval_gain": {side: mean_se([r["eval"][side]["gain"] for r in runs]) for side in ("rhyme", "trl")},
        "prompts_same_order_all_seeds": all(r["prompts"]["same_order"] and r["prompts"]["matches_schedule"]
                                            for r in runs),
        "prompt_tokens_identical_all_seeds": all(r["prompts"]["tokens"]["identical"] for r in runs),
    }


def machine() -> dict:
    """Where the benchmark ran."""
    import torch
    import transformers
    import trl

    return {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def fmt(x, spec: str = ".3f") -> str:
    """A number for the markdown tables (``-`` for None)."""
    return "-" if x is None else format(x, spec)


def seed_markdown(r: dict) -> list[str]:
    """The report section of one seed."""
    p, ev, fw, sec = r["prompts"], r["eval"], r["final_window"], r["seconds_per_step"]
    lines = [f"## Seed {r['seed']} (rhyme-jax run `{r['rhyme_run_dir']}`)", "",
             f"- Same prompts in the same order on both sides: **{'yes' if p['same_order'] else 'NO'}** "
             f"({r['steps']} steps x {r['rows_per_step']} rows; TRL rows per step "
             f"{sorted(set(p['trl_rows_per_step']))}; "
             f"matches the prompt schedule: {'yes' if p['matches_schedule'] else 'NO'}); prompt tokens identical "
             f"(HF tokenizer vs ours, {p['tokens']['unique_prompts']} prompts): "
             f"{'yes' if p['tokens']['identical'] else 'NO'}; EOS ids rhyme-jax {p['tokens']['eos_ours']}, "
             f"TRL {p['tokens']['eos_trl']}", "",
             "| step | reward rhyme-jax | reward TRL | rollout s rhyme-jax | rollout s TRL | update s rhyme-jax "
             "| update s TRL |", "|---|---|---|---|---|---|---|"]
    rh, tr = r["rhyme"], r["trl"]
    for k in range(r["steps"]):
        lines.append(f"| {k + 1} | {fmt(rh['reward_mean'][k])} | {fmt(tr['reward_mean'][k])} | "
                     f"{fmt(rh['rollout_s'][k], '.2f')} | {fmt(tr['rollout_s'][k], '.2f')} | "
                     f"{fmt(rh['update_s'][k], '.2f')} | {fmt(tr['update_s'][k], '.2f')} |")
    after = ev.get("after_step", {"rhyme": r["steps"], "trl": r["steps"]})
    lines += ["", "| held-out greedy | n | before | after | after step | paired gain ± SE |",
              "|---|---|---|---|---|---|"]
    for side, name in (("rhyme", "rhyme-jax"), ("trl", "TRL")):
        e = ev[side]
        lines.append(f"| {name} | {e['n']} | {fmt(e['before'])} | {fmt(e['after'])} | {after[side]} | "
                     f"{e['gain']:+.3f} ± {e['gain_se']:.3f} |")
    lines += ["", f"Before-training greedy correctness agrees on {ev['before_agreement']:.1%} of the problems "
              "(same weights, two engines).", "",
              f"Final window (steps {fw['steps'][0]}-{fw['steps'][1]}): reward rhyme-jax "
              f"{fw['rhyme']['mean']:.3f} ± {fw['rhyme']['se']:.3f}, TRL {fw['trl']['mean']:.3f} ± "
              f"{fw['trl']['se']:.3f}; difference {fw['difference']:+.3f} = "
              f"{fmt(fw['difference_in_se'], '+.2f')} SE.", ""]
    for k, label in (("all", "all steps"), ("steady", "steps >= 2")):
        if sec["rhyme"][k] is None:
            continue
        a, b = sec["rhyme"][k], sec["trl"][k]
        lines.append(f"- Seconds per step, {label}: rhyme-jax {a['total_s']:.2f} (rollout {a['rollout_s']:.2f}, "
                     f"update {a['update_s']:.2f}), TRL {b['total_s']:.2f} (rollout {b['rollout_s']:.2f}, update "
                     f"{b['update_s']:.2f}); ratio rhyme-jax / TRL **{fmt(sec['ratio_rhyme_over_trl'][k], '.2f')}**")
    return lines + [""]


def write_markdown(report: dict, path: Path) -> None:
    """``report.md``: settings, what is not matched, each seed, the summary."""
    m, s = report["machine"], report["summary"]
    lines = ["# TRL GRPOTrainer vs rhyme-jax on the same run", "",
             f"Config `{report['config']}`"
             + (f" with `{' '.join(report['overrides'])}`" if report["overrides"] else "")
             + f"; seeds {report['seeds']}. trl {m['trl']}, transformers {m['transformers']}, torch {m['torch']} "
             f"({m['torch_threads']} threads, OMP_WAIT_POLICY={m['omp_wait_policy'] or 'unset'}); {m['platform']}, "
             f"{m['cpus']} CPUs, load average {m['loadavg_start'][0]:.1f} at the start and "
             f"{m['loadavg_end'][0]:.1f} at the end; {m['date']}.", "",
             "Rollout seconds: rhyme-jax `time/rollout_s`; TRL the trainer's `_generate` (tokenise, `generate`, "
             "decode). Update seconds: rhyme-jax `time/train_s`; TRL the optimizer steps' wall time minus "
             "rollout and reward (it includes TRL's log-prob forward passes). Neither includes the reward.", "",
             *([f"Compared: the first {report['compared_steps']} GRPO steps. TRL trains "
                f"{report['compared_steps']} steps; the rhyme-jax side is the first {report['compared_steps']} steps "
                "of its longer run (a constant learning rate without warm-up: the same run's beginning), and its "
                "held-out 'after' is at the end of that run (the 'after step' column).", ""]
               if report.get("compared_steps") else []),
             "## Summary", "",
             f"- Same prompts in the same order, every seed: {'yes' if s['prompts_same_order_all_seeds'] else 'NO'}; "
             f"same prompt tokens: {'yes' if s['prompt_tokens_identical_all_seeds'] else 'NO'}"]
    fw = s["final_window"]
    lines += [f"- Final-window reward (last {fw['window_steps']} steps, pooled over seeds): rhyme-jax "
              f"{fw['rhyme']['mean']:.3f} ± {fw['rhyme']['se']:.3f}, TRL {fw['trl']['mean']:.3f} ± "
              f"{fw['trl']['se']:.3f};"
              f" difference {fw['difference']:+.3f} = {fmt(fw['difference_in_se'], '+.2f')} SE",
              f"- Held-out paired gain, mean over seeds: rhyme-jax {s['eval_gain']['rhyme'][0]:+.3f}, "
              f"TRL {s['eval_gain']['trl'][0]:+.3f}",
              f"- Seconds per step, rhyme-jax / TRL: {fmt(s['ratio_rhyme_over_trl']['all'], '.2f')} (all steps), "
              f"{fmt(s['ratio_rhyme_over_trl']['steady'], '.2f')} (steps >= 2)", "",
              "## TRL settings (mapped from the config, docs/trl_mapping.md)", "", "```",
              *[f"{k} = {v!r}" for k, v in report["trl_settings"].items()], "```", "",
              "## Not matched", ""]
    lines += [f"- **{u['setting']}**: {u['why']}" for u in report["unmatched"]] + [""]
    for r in report["runs"]:
        lines += seed_markdown(r)
    path.write_text("\n".join(lines) + "\n")


def plot_rewards(report: dict, path: Path) -> None:
    """``rewards.png``: per-step mean reward of both sides, one colour per seed (rhyme-jax solid,
    TRL dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k, r in enumerate(report["runs"]):
        steps = np.arange(1, r["steps"] + 1)
        ax.plot(steps, r["rhyme"]["reward_mean"], "-o", color=f"C{k}", ms=3, label=f"rhyme-jax seed {r['seed']}")
        ax.plot(steps, r["trl"]["reward_mean"], "--s", color=f"C{k}", ms=3, label=f"TRL seed {r['seed']}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward")
    ax.set_title("rhyme-jax vs TRL GRPOTrainer, same prompts")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_seed(args, item: dict, out: Path, window: int) -> dict:
    """Both sides of one seed (the rhyme-jax run first unless given) and their comparison."""
    cfg, seed = item["cfg"], item["seed"]
    rhyme_dir = item["rhyme_dir"] or run_rhyme(args.config, args.overrides, cfg)
    wait_for_summary(rhyme_dir, args.wait_minutes)
    rhyme = read_rhyme(rhyme_dir, cfg, item.get("eval_step"))
    print(f"TRL GRPOTrainer: seed {seed}, {cfg.grpo.steps} steps", flush=True)
    trl_run = run_trl(cfg, out / "trl" / f"seed_{seed}", attn=args.attn, cpu=args.trl_device == "cpu",
                      eval_batch=args.eval_batch)
    trl = trl_steps(trl_run["recorder"], cfg.grpo.minibatches)
    record = compare_seed(seed, cfg, rhyme, trl, trl_run, rhyme_dir, window)
    record["eval"]["after_step"] = {"rhyme": item.get("eval_step") or cfg.grpo.steps, "trl": cfg.grpo.steps}
    record["_units"] = {"rhyme": window_units(rhyme, window), "trl": window_units(trl, window)}
    record["_settings"] = trl_run["settings"]
    record["_starts_from_sft"] = bool(cfg.run.init_from) or (Path(rhyme_dir) / "sft" / "params").exists()
    return record


def wait_for_summary(run_dir: Path, minutes: float) -> None:
    """Poll (every 20 s, up to ``minutes``) until ``run_dir/summary.json`` exists: a run started
    beside this one has finished. Returns at once when it exists or ``minutes`` is 0."""
    deadline = time.time() + 60 * minutes
    while not (Path(run_dir) / "summary.json").is_file() and time.time() < deadline:
        print(f"waiting for {run_dir} to finish ...", flush=True)
        time.sleep(20)


def merge_reports(dirs: list[str], out: Path) -> dict:
    """One report from several ``report.json`` (the same config, other seeds): runs concatenated,
    the summary recomputed over all of them (final-window units: per-step reward means).

    Raises:
      SystemExit: a report is missing or the reports disagree on config, steps or window.
    """
    reports = []
    for d in dirs:
        path = Path(d) / "report.json"
        if not path.is_file():
            raise SystemExit(f"--merge: {path} not found")
        reports.append(json.loads(path.read_text()))
    first = reports[0]
    for r in reports[1:]:
        for key in ("window_steps", "compared_steps", "trl_settings"):
            if r.get(key) != first.get(key):
                raise SystemExit(f"--merge: the reports differ in {key}")
    window = first["window_steps"]
    runs = [dict(run) for r in reports for run in r["runs"]]
    for run in runs:
        run["_units"] = {side: run[side]["reward_mean"][-window:] for side in ("rhyme", "trl")}
    report = dict(first, seeds=[run["seed"] for run in runs], summary=summarize(runs, window),
                  runs=[{k: v for k, v in run.items() if not k.startswith("_")} for run in runs],
                  merged_from=[str(d) for d in dirs])
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=float) + "\n")
    write_markdown(report, out / "report.md")
    plot_rewards(report, out / "rewards.png")
    return report


def main(argv=None) -> int:
    """Run both sides for every seed and write report.md, report.json and rewards.png under --out
    (or, with --merge, combine earlier reports)."""
    args = parse_args(argv)
    if args.merge:
        report = merge_reports([d for d in args.merge.split(",") if d.strip()], Path(args.out))
        print(f"wrote {Path(args.out) / 'report.md'} from {args.merge}", flush=True)
        s = report["summary"]
        return 0 if s["prompts_same_order_all_seeds"] and s["prompt_tokens_identical_all_seeds"] else 1
    if "torch" not in sys.modules:  # libgomp reads it when torch loads
        # Spinning OpenMP workers slow torch 15-40x on a CPU shared with other jobs (measured on 2
        # busy cores: 16 new tokens x 4 rows of SmolLM2-135M, 24-54 s spinning vs 1.5 s passive).
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    load_start = os.getloadavg()
    items = seed_runs(args)
    cfg0 = items[0]["cfg"]
    window = min(args.window or max(1, cfg0.grpo.steps // 4), cfg0.grpo.steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [run_seed(args, item, out, window) for item in items]
    overlong = max(r["prompts"]["tokens"]["overlong"] for r in runs)
    report = {
        "config": str(items[0]["rhyme_dir"] / "config.yaml") if items[0]["rhyme_dir"] else args.config,
        "overrides": [] if items[0]["rhyme_dir"] else args.overrides, "seeds": [i["seed"] for i in items],
        "window_steps": window, "compared_steps": args.steps,
        "machine": dict(machine(), omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", ""),
                        loadavg_start=load_start, loadavg_end=os.getloadavg()),
        "trl_settings": {k: v for k, v in runs[0]["_settings"].items() if k not in ("seed", "data_seed")},
        "unmatched": unmatched(cfg0, starts_from_sft=any(r["_starts_from_sft"] for r in runs), overlong=overlong),
        "summary": summarize(runs, window),
        "runs": [{k: v for k, v in r.items() if not k.startswith("_")} for r in runs],
    }
    (out / "report.json").write_text(json.dumps(report, indent=1, default=float) + "\n")
    write_markdown(report, out / "report.md")
    plot_rewards(report, out / "rewards.png")
    print(f"wrote {out / 'report.md'}, {out / 'report.json'}, {out / 'rewards.png'}", flush=True)
    ok = report["summary"]["prompts_same_order_all_seeds"] and report["summary"]["prompt_tokens_identical_all_seeds"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
