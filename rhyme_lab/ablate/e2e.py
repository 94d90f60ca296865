"""Trainer-driven units: the demo warm start, end-to-end GRPO runs and the paired A4 run.

Each GRPO unit builds ``GRPOTrainer`` from its config, compiles every rollout program of every
worker first (``RolloutEngine.warmup`` in parallel, not timed: the units of a suite then compare
scheduling and decoding, not which of them met a shape first), and runs ``grpo.steps`` steps with
``GRPOTrainer.train_step`` (no held-out evaluation, no checkpoints: the figures need neither).
Per step it keeps the trainer's metrics (rollout / update seconds, tokens, scheduler bubbles and
migrations, HistoSpec acceptance), the step's wall seconds and the XLA compilations inside it.
The first ``skip`` steps (the update compiles in step 1) are left out of the run's totals.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

KEEP = ("time/rollout_s", "time/train_s", "time/rollout_makespan_s", "rollout/generated_tokens",
        "rollout/tokens_per_s", "rollout/forward_passes", "rollout/tokens_per_forward", "rollout/epoch",
        "sched/bubble_fraction", "sched/earliest_finisher_idle", "sched/migrated_share",
        "spec/drafted_tokens", "spec/accepted_tokens", "spec/acceptance_rate", "spec/drafting_share",
        "reward/mean", "response_length/mean")
PAIR_STATS = ("generated_tokens", "seconds", "forward_passes", "sequence_steps", "drafted_tokens",
              "accepted_tokens", "drafting_seconds", "compiles", "decode_dispatches", "spec_chunk_seconds",
              "spec_chunk_passes", "spec_chunk_row_passes", "spec_chunks_declined")


def run_sft_unit(cfg, progress, *, skip: int = 0, warmup: bool = True) -> dict:
    """``sft.steps`` of supervised warm start (as ``train.warm_start``): params and tokenizer in
    the unit's run directory. Returns the last step's loss and token accuracy and, when
    ``warmup`` (the scale compiles ahead; the tests do not), the held-out greedy accuracy."""
    from flax import nnx

    from rhyme_jax.data import load_problems
    from rhyme_jax.io import checkpoint as ckpt
    from rhyme_jax.train.assembly import make_engine, run_dir_of
    from rhyme_jax.train.evaluate import evaluate_run
    from rhyme_jax.train.policy import build_model, build_tokenizer, compute_params, eos_ids, rollout_dtype
    from rhyme_jax.train.sft import run_sft
    from rhyme_jax.train.warm_start import sft_params_dir

    run_dir = run_dir_of(cfg)
    if cfg.sft.steps < 1:
        return {"run_dir": str(run_dir), "skipped": "sft.steps=0: the runs start from model.path"}
    train, held_out = load_problems(cfg.data)
    tokenizer = build_tokenizer(cfg, run_dir, train)
    last: dict = {}

    def log(step: int, m: dict) -> None:
        last.update(m)
        progress(step, cfg.sft.steps, f"SFT step {step}/{cfg.sft.steps}")

    model = run_sft(build_model(cfg, tokenizer, cfg.run.seed), tokenizer, train, cfg.sft,
                    prompt_template=cfg.model.prompt_template, seed=cfg.run.seed, progress=False, log_fn=log)
    graphdef, state = nnx.split(model)
    ckpt.save_params(sft_params_dir(run_dir), state)
    out = {"run_dir": str(run_dir), "params": str(sft_params_dir(run_dir)), "sft_steps": cfg.sft.steps,
           "loss": last.get("loss"), "token_accuracy": last.get("token_accuracy")}
    if warmup:
        engine = make_engine(graphdef, model.cfg, cfg, eos_ids(model, tokenizer))
        res = evaluate_run(engine, compute_params(state, rollout_dtype(cfg)), tokenizer, held_out, cfg)
        out.update(accuracy=res.accuracy, stderr=res.stderr, n=res.n)
    return out


def warm_up(trainer) -> float:
    """Compile every rollout program of every worker (``engine.warmup`` for the run's sampling,
    verify programs when HistoSpec is on), one engine per host core at a time; returns seconds."""
    from concurrent.futures import ThreadPoolExecutor

    from rhyme_jax.rollout.engine import SamplingParams

    sp = SamplingParams.from_section(trainer.cfg.rollout)
    states = trainer.rollout_states()
    engines = trainer.engines
    spec = bool(trainer.cfg.spec.enabled)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, min(len(engines), os.cpu_count() or 1))) as pool:
        list(pool.map(lambda i: engines[i].warmup(states[i], sp, spec=spec), range(len(engines))))
    return time.perf_counter() - t0


def _train(trainer, progress, pairs: list | None = None) -> list[dict]:
    """``grpo.steps`` GRPO steps; one row per step (``KEEP`` metrics, ``wall_s``, ``compiles``
    and, for a paired run, the summed ``plain`` / ``spec`` (and, beside an oracle, ``first`` and
    ``own``) rollout stats of the step)."""
    from rhyme_jax.compile_count import CompileCounter

    total = trainer.cfg.grpo.steps
    rows = []
    with CompileCounter() as counter:
        for step in range(1, total + 1):
            c0, n0 = counter.count, len(pairs) if pairs is not None else 0
            t0 = time.perf_counter()
            m = trainer.train_step(step)
            trainer.step = step
            row = {"step": step, "wall_s": time.perf_counter() - t0, "compiles": counter.count - c0,
                   **{k: float(m[k]) for k in KEEP if k in m}}
            if pairs is not None:
                for kind in ("first", "plain", "own", "spec"):  # beside an oracle: "first" (its tokens), "own" drafter
                    if all(kind in p for p in pairs[n0:]) and (kind in ("plain", "spec") or len(pairs) > n0):
                        row[kind] = {k: float(sum(p[kind].get(k, 0) for p in pairs[n0:])) for k in PAIR_STATS}
            rows.append(row)
            progress(step, total, f"GRPO step {step}/{total}")
    return rows


def _analysis(run_dir: Path) -> dict:
    """RhymeRL O5/O6 of the run's saved rollouts (``python -m rhyme_lab analyze``), or ``{"error": ...}``."""
    from rhyme_lab.analyze import AnalyzeError, analyze, write_analysis

    try:
        result = analyze(run_dir)
    except AnalyzeError as exc:
        return {"error": str(exc)}
    write_analysis(run_dir, result)
    return {"overall": result["overall"], "epochs": result["epochs"]}


def _grpo_unit(cfg, progress, *, paired: bool, warmup: bool, oracle: str = "", twin: str = "",
               held_out: bool = False) -> dict:
    from rhyme_jax.train.trainer import GRPOTrainer
    from rhyme_lab.ablate.before_eval import before_eval

    pairs: list | None = [] if paired else None
    twins: dict[int, dict] = {}
    callbacks = []
    if paired:
        from rhyme_lab.ablate.paired import PairedRollouts

        callbacks.append(PairedRollouts(pairs, oracle, cfg.spec.history_depth))
    if twin:
        from rhyme_lab.ablate.paired_placement import TwinPlacement

        callbacks.append(TwinPlacement(twin, twins))
    trainer = GRPOTrainer(cfg, callbacks=callbacks)
    try:
        progress(0, cfg.grpo.steps, "compiling the rollout programs")
        warm = warm_up(trainer) if warmup else 0.0
        if held_out:  # greedy held-out accuracy before and after, per problem (eval/), outside the timed steps
            progress(0, cfg.grpo.steps, "held-out evaluation before GRPO")
            trainer.record_eval(0, before_eval(trainer, cfg), before=True)
        steps = _train(trainer, progress, pairs)
        if held_out:
            progress(cfg.grpo.steps, cfg.grpo.steps, "held-out evaluation after GRPO")
            trainer.record_eval(cfg.grpo.steps, trainer.evaluate())
            trainer.save()  # the final policy, for later evaluations (checkpoints/)
        for row in steps:
            if row["step"] in twins:
                row["twin"] = twins[row["step"]]
        workers = len(trainer.engines)
        cost = trainer.engines[0].pass_cost
    finally:
        trainer.close()
    return {"run_dir": str(trainer.run_dir), "workers": workers, "warmup_s": warm, "steps": steps,
            "rows_per_step": cfg.grpo.prompts_per_step * cfg.grpo.samples_per_prompt,
            "sched": {"mode": cfg.sched.mode, "tier1": cfg.sched.tier1, "tier2": cfg.sched.tier2,
                      "migration": cfg.sched.migration}, "spec": bool(cfg.spec.enabled),
            "analysis": _analysis(trainer.run_dir), "step_cost": pass_cost_rows(cost)}


def pass_cost_rows(cost) -> dict:
    """Worker 0's pass-cost model at the end of the run, as JSON: ``profiled`` rows of ``[rows,
    tokens, max_q_len, seconds]`` and ``live`` rows (median of its recent passes at one page-table
    width, where it has one) of ``[rows, tokens, max_q_len, width, seconds]``
    and ``meta`` (``rollout.pass_cost.PassCost``; empty rows: the analytical prior)."""
    live = [[*k, v[1]] for k, v in sorted(cost.live.items()) if v[1] is not None]
    return {"profiled": [[*k, s] for k, s in sorted(cost.seconds.items())], "live": live, "meta": dict(cost.meta)}


def run_e2e(cfg, progress, *, skip: int = 1, warmup: bool = True, held_out: bool = False) -> dict:
    """GRPO steps on the config's rollout workers, timed end to end (module docstring); with
    ``held_out`` the greedy held-out evaluation before and after them (``eval/``, untimed)."""
    out = _grpo_unit(cfg, progress, paired=False, warmup=warmup, held_out=held_out)
    out["skip"] = skip
    return out


def run_twin_placement(cfg, progress, *, skip: int = 1, warmup: bool = True, twin: str = "fifo") -> dict:
    """GRPO steps on the config's rollout workers whose every rollout is also placed by a twin
    scheduler in mode ``twin`` just before or after it (``paired_placement``); each step row
    carries the twin's makespan, idle share and seconds under ``"twin"``."""
    out = _grpo_unit(cfg, progress, paired=False, warmup=warmup, twin=twin)
    out["twin"] = twin
    out["skip"] = skip
    return out


def run_paired(cfg, progress, *, skip: int = 1, warmup: bool = True, oracle: str = "",
               held_out: bool = False) -> dict:
    """GRPO steps whose every rollout is generated plain and with HistoSpec (``paired``); with
    ``oracle`` (``paired.ORACLES``) the second rollout drafts with that oracle drafter instead
    (over the prompt's last ``spec.history_depth`` rollouts for ``"sources"``); ``held_out``: as
    ``run_e2e``."""
    out = _grpo_unit(cfg, progress, paired=True, warmup=warmup, oracle=oracle, held_out=held_out)
    out["oracle"] = oracle
    out["skip"] = skip
    return out
