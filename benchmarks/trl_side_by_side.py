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

    python -m benchmarks.trl_side_by_side --config configs/arith_smollm2_135m.yaml --seeds 0,1
    python -m benchmarks.trl_side_by_side --rhyme-run-dir runs/arith_smollm2_135m   # a finished run

TRL runs on CPU in float32 (``bf16`` autocast when ``model.dtype=bfloat16``), without vLLM. What TRL
cannot match is listed in the report (``unmatched``), with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rhyme_lab.bench.trl_mapping import SideBySideError, seed_runs, unmatched
from rhyme_lab.bench.trl_report import (compare_seed, machine, merge_reports, plot_rewards, summarize, window_units,
                                        write_markdown)
from rhyme_lab.bench.trl_run import read_rhyme, run_rhyme, run_trl, trl_steps, wait_for_summary


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
    try:
        sys.exit(main())
    except SideBySideError as exc:
        sys.exit(f"python -m benchmarks.trl_side_by_side: {exc}")
