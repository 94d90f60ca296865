"""``rhyme-jax sft | train | eval | demo``: the commands that train or score a policy.

Outputs go to ``<run.runs_dir>/<run.name>/``. ``train --dry-run`` prints the resolved config, the
memory plan and the rollout program count, and trains nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rhyme_jax.cli.common import add_command, load_run_config, report, user_errors
from rhyme_jax.config import RunConfig


def register(sub) -> None:
    """Add ``sft``, ``train``, ``eval`` and ``demo`` to the ``rhyme-jax`` subparsers."""
    add_command(sub, "sft", "supervised warm start on worked solutions (saved as <run_dir>/sft/params)", run,
                examples=("rhyme-jax sft --config configs/default.yaml --set sft.steps=100",))
    tr = add_command(sub, "train", "GRPO training (starts from <run_dir>/sft/params when present)", run,
                     examples=("rhyme-jax train --config configs/arith_smollm2_135m.yaml",
                               "rhyme-jax train --config configs/arith_smollm2_135m.yaml --set grpo.steps=2 "
                               "--set run.name=try",
                               "rhyme-jax train --config configs/arith_smollm2_135m.yaml --resume",
                               "rhyme-jax train --config configs/gsm8k_qwen2.5_1.5b.yaml --set model.path=CKPT_DIR --dry-run"))
    tr.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    tr.add_argument("--dry-run", action="store_true", help="print the resolved config, the memory plan and the "
                    "rollout program count, then stop (nothing is trained; a known model named in the config "
                    "is imported into the cache on first use)")
    ev = add_command(sub, "eval", "greedy held-out accuracy of a run's newest checkpoint", run,
                     examples=("rhyme-jax eval --config configs/arith_smollm2_135m.yaml",
                               "rhyme-jax eval --config configs/arith_smollm2_135m.yaml --checkpoint initial "
                               "--set run.eval_samples=8",
                               "rhyme-jax eval --config configs/arith_smollm2_135m.yaml --checkpoint initial --save before.npz",
                               "rhyme-jax eval --config configs/arith_smollm2_135m.yaml --paired-with before.npz"))
    ev.add_argument("--checkpoint", default="", help="params directory (default: the run's newest); "
                    "'initial' scores the starting model (model.path, or run.init_from) before any "
                    "training, e.g. to check pass@k headroom with --set run.eval_samples=8")
    ev.add_argument("--save", default="", help="write the per-problem results (.npz: correct, sampled) to this file")
    ev.add_argument("--paired-with", default="", help="a file --save wrote for another checkpoint on the same "
                    "problems: also print the paired gain over it (mean, standard error, z)")
    dm = add_command(sub, "demo", "warm start (SFT) + GRPO + summary: the CPU demo", run,
                     examples=("rhyme-jax demo", "rhyme-jax demo --resume",
                               "rhyme-jax demo --set run.seed=1 --set run.name=demo_seed1"))
    dm.add_argument("--resume", action="store_true", help="continue an interrupted demo")
    dm.add_argument("--dry-run", action="store_true", help="as train --dry-run")


def run(args: argparse.Namespace) -> int:
    """Run one of the training commands; returns the exit status (2: bad input, 1: the loss
    became non-finite)."""
    cfg = load_run_config(args, required=True)
    if cfg is None:
        return 2
    if args.command == "sft" and cfg.sft.steps < 1:  # `train` / `demo` skip the warm start instead
        print(f"rhyme-jax: config error: {args.config}: sft.steps={cfg.sft.steps} must be >= 1 for "
              f"`rhyme-jax sft`", file=sys.stderr)
        return 2
    try:
        if getattr(args, "dry_run", False):
            return dry_run(cfg)
        from rhyme_jax import compile_cache
        from rhyme_jax.parallel import distributed

        compile_cache.enable(cfg.run.compile_cache)  # before anything compiles
        distributed.initialize(cfg.parallel)  # before any device is touched; no-op on one host
        _banner(cfg, args.command)
        if args.command == "sft":
            return cmd_sft(cfg)
        if args.command == "eval":
            return cmd_eval(cfg, args.checkpoint, args.save, args.paired_with)
        reward_fn = getattr(args, "reward_fn", None)
        return cmd_train(cfg, args.resume, warm_start=args.command == "demo", reward_fn=reward_fn)
    except user_errors() as exc:
        return report(args.command, exc)


def dry_run(cfg: RunConfig) -> int:
    """``--dry-run``: the resolved config (YAML), the memory plan (``train.memory_plan``) and the
    rollout step programs the run compiles (``rollout.shapes``); no device work beyond compiling
    the update with abstract weights."""
    from rhyme_jax.config import to_yaml
    from rhyme_jax.rollout.shapes import programs_from_config
    from rhyme_jax.train.memory_plan import memory_report, print_report

    print("# resolved config")
    print(to_yaml(cfg).rstrip())
    print("\n# memory plan")
    print_report(memory_report(cfg))
    programs = programs_from_config(cfg)
    kinds = {}
    for prog in programs:
        kinds[prog.kind] = kinds.get(prog.kind, 0) + 1
    print(f"\n# rollout step programs: {len(programs)} ("
          + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) + "); `rhyme-jax compile-report` times them")
    print("dry run: nothing trained")
    return 0


def _banner(cfg: RunConfig, command: str) -> None:
    import jax

    print(f"rhyme-jax {command}: run '{cfg.run.name}' on {jax.device_count()} "
          f"{jax.default_backend()} device(s); model: {cfg.model.path or 'tiny demo model'}; "
          f"data: {cfg.data.source}", flush=True)


def cmd_sft(cfg: RunConfig) -> int:
    """``rhyme-jax sft``: the warm start alone."""
    from rhyme_jax.train.assembly import run_dir_of
    from rhyme_jax.train.warm_start import run_warm_start

    run_dir = run_dir_of(cfg)
    res = run_warm_start(cfg, run_dir)
    print(f"SFT done: held-out greedy accuracy {res.accuracy:.3f} ± {res.stderr:.3f} (n={res.n}); "
          f"params in {run_dir / 'sft' / 'params'} (rhyme-jax train with the same run.name starts "
          f"from them)")
    return 0


def cmd_train(cfg: RunConfig, resume: bool, *, warm_start: bool = False, reward_fn=None) -> int:
    """``rhyme-jax train`` (and ``demo`` with ``warm_start``: the SFT warm start first unless done)."""
    from rhyme_jax.compile_count import CompileCounter
    from rhyme_jax.train.assembly import run_dir_of
    from rhyme_jax.io.plots import plot_run
    from rhyme_jax.io.summary import build_summary, print_summary, write_summary
    from rhyme_jax.train.trainer import GRPOTrainer, RunExistsError, has_checkpoints
    from rhyme_jax.train.warm_start import run_warm_start, sft_params_dir

    t0 = time.perf_counter()
    run_dir = run_dir_of(cfg)
    if resume and not run_dir.is_dir():
        raise FileNotFoundError(f"--resume: {run_dir} does not exist, so there is nothing to resume (run.name="
                                f"{cfg.run.name!r}); drop --resume to start a fresh run")
    if not resume and has_checkpoints(run_dir):
        raise RunExistsError(f"{run_dir} already has GRPO checkpoints: pass --resume to continue "
                             f"it, or --set run.name=NEW for a fresh run")
    done = run_dir / "summary.json"
    if resume and done.is_file() and json.loads(done.read_text()).get("steps") == cfg.grpo.steps:
        print(f"{run_dir} is already complete ({cfg.grpo.steps} GRPO steps); its summary:")
        print_summary(json.loads(done.read_text()))
        return 0
    counter = CompileCounter().start()
    warm = None
    if warm_start and cfg.sft.steps > 0 and not cfg.run.init_from and not sft_params_dir(run_dir).exists():
        warm = run_warm_start(cfg, run_dir)
        print(f"warm start done: held-out greedy accuracy {warm.accuracy:.3f} "
              f"± {warm.stderr:.3f}", flush=True)
    trainer = GRPOTrainer(cfg, resume=resume, reward_fn=reward_fn)
    if warm is not None and trainer.step == 0 and trainer.eval_before is None:
        # The GRPO run starts from exactly the params just evaluated (same seeds: same result).
        trainer.record_eval(0, warm, before=True)
    try:
        result = trainer.fit()
    finally:
        trainer.close()
    plot = plot_run(run_dir)
    summary = build_summary(run_dir, result, wall_seconds=time.perf_counter() - t0,
                            compiles=counter.count, compile_stats=_compile_stats(cfg, trainer, counter))
    counter.stop()
    write_summary(run_dir, summary)
    print(f"outputs: {run_dir} (metrics.jsonl, tb/, checkpoints/, rollouts/, eval/, schedule/, {plot.name}, "
          f"gantt.png, summary.md, summary.json)")
    return 0


def _compile_stats(cfg: RunConfig, trainer, counter) -> dict:
    """Warm-up figures of a run for its summary: XLA compiles vs persistent-cache loads, their
    seconds, and the rollout step programs run vs enumerated (``rollout.shapes``)."""
    from rhyme_jax.compile_cache import resolve
    from rhyme_jax.rollout.shapes import programs_from_config

    engines = getattr(trainer, "engines", None) or [trainer.engine]
    run_ = set().union(*(getattr(e, "programs_run", set()) for e in engines))
    path = resolve(cfg.run.compile_cache)
    return {**counter.stats(), "cache_dir": str(path) if path else "",
            "programs_run": len(run_), "programs_enumerated": len(programs_from_config(cfg))}


def cmd_eval(cfg: RunConfig, checkpoint: str, save: str = "", paired_with: str = "") -> int:
    """``rhyme-jax eval``: greedy (and, with ``run.eval_samples``, sampled pass@k) held-out
    accuracy of a checkpoint, the run's newest, or the starting model (``initial``); ``save``:
    the per-problem results' file; ``paired_with``: such a file of another checkpoint, whose
    paired gain is printed too. Raises ``io.summary.PairedEvalError`` (before any work) where that
    file is missing or unreadable, and after the evaluation where it scores another number of problems."""
    baseline = _load_eval(paired_with) if paired_with else None
    from rhyme_jax.parallel.mesh import train_mesh
    from rhyme_jax.io import checkpoint as ckpt
    from rhyme_jax.train.assembly import build_policy, run_dir_of, warm_start_dir

    run_dir = run_dir_of(cfg)
    policy, state = build_policy(cfg, run_dir, train_mesh(1, 1, 1))  # one device
    if cfg.lora.rank > 0 and checkpoint != "initial":  # a LoRA run's checkpoints hold its adapters
        return _eval_lora(cfg, run_dir, policy, state, checkpoint, save, baseline)
    if checkpoint == "initial":  # what `rhyme-jax train` would start from
        start = warm_start_dir(cfg, run_dir)
        if start is not None:
            state = ckpt.load_params(start, state)
        source = f"initial model ({start or cfg.model.path or 'tiny model, fresh init'})"
    elif checkpoint:
        state = ckpt.load_params(Path(checkpoint), state)
        source = checkpoint
    else:
        c = ckpt.Checkpointer(run_dir / "checkpoints")
        step = c.latest_step()
        if step is None:
            c.close()
            raise FileNotFoundError(f"no checkpoint in {run_dir / 'checkpoints'}; pass --checkpoint")
        optimizer_free_state, _, _ = c.restore(step, params_like=state, opt_state_like=None)
        c.close()
        state, source = optimizer_free_state, f"{run_dir / 'checkpoints'} step {step}"
    return _report_eval(cfg, policy, state, source, save, baseline)


def _load_eval(path: str) -> dict:
    """``{"path", "correct"}`` of a file ``rhyme-jax eval --save`` wrote. Raises ``PairedEvalError`` naming it."""
    import numpy as np

    from rhyme_jax.io.summary import PairedEvalError

    try:
        with np.load(path) as f:
            return {"path": path, "correct": np.asarray(f["correct"], np.float64)}
    except (OSError, KeyError, ValueError) as exc:
        raise PairedEvalError(f"--paired-with {path}: not a per-problem eval file of rhyme-jax eval --save "
                              f"({exc})") from None


def _eval_lora(cfg: RunConfig, run_dir: Path, policy, base, checkpoint: str, save: str = "",
               baseline: dict | None = None) -> int:
    """``rhyme-jax eval`` of a LoRA run: the adapters of ``checkpoint`` (default: the newest
    checkpoint) merged into the base the run started from (``lora_export.merged_params``)."""
    from rhyme_jax.io import checkpoint as ckpt
    from rhyme_jax.train.assembly import load_warm_start
    from rhyme_jax.train.lora_export import load_adapters, merged_params

    path = Path(checkpoint) if checkpoint else None
    if path is None:
        steps = ckpt.complete_steps(run_dir / "checkpoints")
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {run_dir / 'checkpoints'}; pass --checkpoint")
        path = run_dir / "checkpoints" / str(steps[-1])
    base = load_warm_start(cfg, run_dir, base)
    state = merged_params(cfg, base, load_adapters(cfg, policy.model_cfg, path))
    return _report_eval(cfg, policy, state, f"{path} (LoRA adapters merged)", save, baseline)


def _report_eval(cfg: RunConfig, policy, state, source: str, save: str = "", baseline: dict | None = None) -> int:
    """Evaluate ``state`` (float32 params) on the held-out problems and print the line of ``rhyme-jax eval``
    (with ``save``, write the per-problem file; with ``baseline``, print the paired gain over it)."""
    import numpy as np

    from rhyme_jax.train.assembly import make_engine
    from rhyme_jax.train.evaluate import evaluate_run
    from rhyme_jax.train.policy import compute_params, rollout_dtype

    engine = make_engine(policy.graphdef, policy.model_cfg, cfg, policy.eos)
    # The float32 master weights evaluated on a rollout-dtype copy, as the run's evaluations are.
    state = compute_params(state, rollout_dtype(cfg))
    res = evaluate_run(engine, state, policy.tokenizer, policy.eval_problems, cfg)
    sampled = (f", pass@1 at T = {cfg.rollout.temperature:g} (mean of {res.samples} samples) "
               f"{res.sampled_accuracy:.3f} ± {res.sampled_stderr:.3f}, pass@{res.samples} {res.pass_at_k:.3f}"
               if res.samples else "")
    print(f"{source}: held-out greedy accuracy {res.accuracy:.3f} ± {res.stderr:.3f} (n={res.n})"
          f"{sampled}, mean response length {res.mean_length:.1f} tokens")
    if save:
        res.save(Path(save))
        print(f"per-problem results: {save}")
    if baseline is not None:
        from rhyme_jax.io.summary import PairedEvalError, paired_gain

        if baseline["correct"].shape != res.correct.shape:
            raise PairedEvalError(f"--paired-with {baseline['path']}: {baseline['correct'].size} problems, this "
                             f"evaluation {res.n}: pair evaluations of the same held-out set")
        gain, se = paired_gain(baseline["correct"], res.correct)
        z = f", z {gain / se:.1f}" if se > 0 else ""
        print(f"paired over {baseline['path']}: {np.mean(baseline['correct']):.3f} -> {res.accuracy:.3f}, "
              f"gain {gain:+.3f} ± {se:.3f}{z} (n={res.n})")
    return 0
