"""``rhyme-jax`` command line: sft | train | eval | demo | analyze | memory | models | convert-gguf | ablate.

Every command but ``analyze RUN_DIR`` takes ``--config configs/X.yaml`` and any number of
``--set a.b=c`` overrides. Outputs go to ``<run.runs_dir>/<run.name>/``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rhyme_jax import cli_ablate, cli_compile, cli_memory, cli_models, cli_replay
from rhyme_jax.config import ConfigError, RunConfig, load_config

DEFAULT_CONFIG = "configs/default.yaml"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rhyme-jax", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("--config", default=DEFAULT_CONFIG, help="YAML run config (default: %(default)s)")
        sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set grpo.steps=10 (repeatable)")
        return sp

    add("sft", "supervised warm start on worked solutions")
    tr = add("train", "GRPO training (starts from <run_dir>/sft/params when present)")
    tr.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    ev = add("eval", "greedy held-out accuracy of a run's newest checkpoint")
    ev.add_argument("--checkpoint", default="", help="params directory (default: the run's newest); "
                    "'initial' scores the starting model (model.path, or run.init_from) before any "
                    "training, e.g. to check pass@k headroom with --set run.eval_samples=8")
    dm = add("demo", "warm start (SFT) + GRPO + summary: the CPU demo")
    dm.add_argument("--resume", action="store_true", help="continue an interrupted demo")
    cli_memory.add_arguments(add("memory", "per-device memory of params, optimizer state and one "
                                 "GRPO update under the config (from shapes; allocates nothing)"))
    an = sub.add_parser("analyze", help="RhymeRL O5/O6 (token rhyme, length-rank shifts) of a "
                        "run's saved rollouts")
    an.add_argument("run_dir", help="run directory holding rollouts/step_*.npz")
    an.add_argument("--branch", choices=("reward", "count"), default="reward",
                    help="draft branch rule (default: %(default)s)")
    an.add_argument("--window", choices=("aimd", "mimd", "fixed"), default="aimd",
                    help="draft window policy (default: %(default)s)")
    cli_models.add_parsers(sub)
    cli_compile.add_parser(sub)
    cli_replay.add_parser(sub)
    cli_ablate.add_parser(sub)
    return p


def cmd_analyze(run_dir: str, branch: str, window: str) -> int:
    from rhyme_jax.spec.analyze import analyze, format_table, write_analysis

    result = analyze(run_dir, branch=branch, window=window)
    print(format_table(result))
    paths = write_analysis(run_dir, result)
    print(f"outputs: {paths['md']}, {paths['json'].name}, {paths['png'].name}")
    return 0


def _banner(cfg: RunConfig, command: str) -> None:
    import jax

    print(f"rhyme-jax {command}: run '{cfg.run.name}' on {jax.device_count()} "
          f"{jax.default_backend()} device(s); model: {cfg.model.path or 'tiny demo model'}; "
          f"data: {cfg.data.source}", flush=True)


def cmd_sft(cfg: RunConfig) -> int:
    from rhyme_jax.train.assembly import run_dir_of
    from rhyme_jax.train.warm_start import run_warm_start

    run_dir = run_dir_of(cfg)
    res = run_warm_start(cfg, run_dir)
    print(f"SFT done: held-out greedy accuracy {res.accuracy:.3f} ± {res.stderr:.3f} (n={res.n}); "
          f"params in {run_dir / 'sft' / 'params'} (rhyme-jax train with the same run.name starts "
          f"from them)")
    return 0


def cmd_train(cfg: RunConfig, resume: bool, *, warm_start: bool = False, reward_fn=None) -> int:
    from rhyme_jax.compile_count import CompileCounter
    from rhyme_jax.train.assembly import run_dir_of
    from rhyme_jax.train.plots import plot_run
    from rhyme_jax.train.summary import build_summary, print_summary, write_summary
    from rhyme_jax.train.trainer import GRPOTrainer, RunExistsError, has_checkpoints
    from rhyme_jax.train.warm_start import run_warm_start, sft_params_dir

    t0 = time.perf_counter()
    run_dir = run_dir_of(cfg)
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
    run = set().union(*(getattr(e, "programs_run", set()) for e in engines))
    path = resolve(cfg.run.compile_cache)
    return {**counter.stats(), "cache_dir": str(path) if path else "",
            "programs_run": len(run), "programs_enumerated": len(programs_from_config(cfg))}


def cmd_eval(cfg: RunConfig, checkpoint: str) -> int:
    from rhyme_jax.parallel.mesh import train_mesh
    from rhyme_jax.train import checkpoint as ckpt
    from rhyme_jax.train.assembly import build_policy, make_engine, run_dir_of, warm_start_dir
    from rhyme_jax.train.evaluate import evaluate_run
    from rhyme_jax.train.policy import compute_dtype, compute_params

    run_dir = run_dir_of(cfg)
    policy, state = build_policy(cfg, run_dir, train_mesh(1, 1, 1))  # one device
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
    engine = make_engine(policy.graphdef, policy.model_cfg, cfg, policy.eos)
    # The float32 master weights evaluated on a model.dtype copy, as the run's evaluations are.
    state = compute_params(state, compute_dtype(cfg.model.dtype))
    res = evaluate_run(engine, state, policy.tokenizer, policy.eval_problems, cfg)
    sampled = (f", pass@1 at T = {cfg.rollout.temperature:g} (mean of {res.samples} samples) "
               f"{res.sampled_accuracy:.3f} ± {res.sampled_stderr:.3f}, pass@{res.samples} {res.pass_at_k:.3f}"
               if res.samples else "")
    print(f"{source}: held-out greedy accuracy {res.accuracy:.3f} ± {res.stderr:.3f} (n={res.n})"
          f"{sampled}, mean response length {res.mean_length:.1f} tokens")
    return 0


def main(argv: list[str] | None = None, *, reward_fn=None) -> int:
    """Entry point of the ``rhyme-jax`` console script; returns the process exit status.
    ``reward_fn``: ``(response_text, problem) -> float`` GRPO reward of ``train`` / ``demo``
    instead of the task's (for tests driving the CLI in process or in a subprocess)."""
    args = _parser().parse_args(argv)
    if args.command in ("models", "convert-gguf"):
        return cli_models.run(args)
    if args.command == "compile-report":
        return cli_compile.run(args)
    if args.command == "replay-drafts":
        return cli_replay.run(args)
    if args.command == "ablate":
        return cli_ablate.run(args)
    if args.command == "analyze":
        from rhyme_jax.spec.analyze import AnalyzeError
        from rhyme_jax.io.rollout_log import RolloutLogError

        try:
            return cmd_analyze(args.run_dir, args.branch, args.window)
        except (AnalyzeError, RolloutLogError) as exc:
            print(f"rhyme-jax analyze: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"rhyme-jax: config error: {exc}", file=sys.stderr)
        return 2
    if args.command == "sft" and cfg.sft.steps < 1:  # `train` / `demo` skip the warm start instead
        print(f"rhyme-jax: config error: {args.config}: sft.steps={cfg.sft.steps} must be >= 1 for "
              f"`rhyme-jax sft`", file=sys.stderr)
        return 2
    try:
        if args.command == "memory":
            return cli_memory.cmd_memory(cfg, args)
        from rhyme_jax import compile_cache

        compile_cache.enable(cfg.run.compile_cache)  # before anything compiles
        from rhyme_jax.parallel import distributed

        distributed.initialize(cfg.parallel)  # before any device is touched; no-op on one host
        _banner(cfg, args.command)
        if args.command == "sft":
            return cmd_sft(cfg)
        if args.command == "train":
            return cmd_train(cfg, args.resume, reward_fn=reward_fn)
        if args.command == "eval":
            return cmd_eval(cfg, args.checkpoint)
        return cmd_train(cfg, args.resume, warm_start=True, reward_fn=reward_fn)
    except _user_errors() as exc:
        print(f"rhyme-jax {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1 if type(exc).__name__ == "NonFiniteLossError" else 2


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors caused by the user's input (config, data, checkpoint, prompts): reported in one
    line instead of a traceback."""
    from rhyme_jax.data import DataError
    from rhyme_jax.model.config import ModelConfigError
    from rhyme_jax.model.hub import ModelImportError
    from rhyme_jax.model.loader import CheckpointFormatError
    from rhyme_jax.model.tokenizer import TokenizerError
    from rhyme_jax.parallel.distributed import DistributedConfigError
    from rhyme_jax.parallel.mesh import MeshConfigError
    from rhyme_jax.parallel.rules import ShardingRuleError
    from rhyme_jax.rollout.engine import EngineConfigError, PromptTooLongError
    from rhyme_jax.train.checkpoint import CheckpointError
    from rhyme_jax.train.policy import PolicyConfigError
    from rhyme_jax.train.trainer import NonFiniteLossError, RunExistsError

    return (DataError, ModelConfigError, CheckpointFormatError, TokenizerError, EngineConfigError,
            PromptTooLongError, CheckpointError, PolicyConfigError, NonFiniteLossError,
            RunExistsError, FileNotFoundError, MeshConfigError, ShardingRuleError,
            DistributedConfigError, ModelImportError)


if __name__ == "__main__":
    sys.exit(main())
