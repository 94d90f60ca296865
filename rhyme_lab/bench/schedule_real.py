"""HistoPipe on a real model (``python -m benchmarks.schedule --mode profile | workers``): one
rollout worker's cost model derived from the engine's pass-cost profile, checked and saved
(``run_profile``), and the planner's configurations on W real rollout workers (``run_workers_mode``). The model-free parts (grid, fit report, saved
steps, medians, tables) are ``rhyme_lab.schedule.profile``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rhyme_jax.io.atomic import atomic_write
from rhyme_jax.sched.cost_model import CostModel
from rhyme_jax.sched.length_predictor import predict_lengths
from rhyme_lab.schedule.profile import (CROSS_STEP_CONFIGS, WORKER_CONFIGS, WORKER_FULL, BenchSetupError,
                                     check_rows, corr, fit_report, format_profile_table, format_workers_table,
                                     profile_grid, step_row, summarize_workers, worker_steps)
from rhyme_jax.sched.timeline import plot_gantt


def _enable_compile_cache(path: str) -> None:
    """Persistent XLA compilation cache at ``path`` ("" = off; as ``benchmarks.rollout``: warm-up is
    never timed)."""
    import jax

    if path:
        jax.config.update("jax_compilation_cache_dir", str(path))


def _require_params(init_from: str) -> None:
    """Raise ``BenchSetupError`` when ``init_from`` does not exist (checked before any set-up)."""
    if not Path(init_from).exists():
        raise BenchSetupError(f"no params at --init-from {init_from}; run `rhyme-jax sft` (the demo) first")


def load_policy(config: str, overrides: list[str], init_from: str, run_dir: str):
    """The demo policy as the trainer builds it (``rhyme_jax.train.assembly.build_policy`` on one
    device: config, the run's tokenizer, train problems, model) with the params of ``init_from``
    (``runs/demo/sft`` or a ``checkpoints/<step>``). The tokenizer (``<run_dir>/tokenizer.json``
    for the demo model) is never trained anew: it must match the params. Returns
    ``(policy, params)``.

    Raises:
      BenchSetupError: no params at ``init_from`` or no tokenizer file.
    """
    from rhyme_jax.config import load_config
    from rhyme_jax.parallel.mesh import train_mesh
    from rhyme_jax.train.assembly import build_policy
    from rhyme_jax.io.checkpoint import load_params
    from rhyme_jax.train.policy import tokenizer_file

    _require_params(init_from)
    cfg = load_config(config, overrides)
    tok = tokenizer_file(cfg, Path(run_dir))
    if not tok.is_file():
        raise BenchSetupError(f"no tokenizer at {tok} (the run that trained --init-from writes it; pass --run-dir)")
    policy, state = build_policy(cfg, Path(run_dir), train_mesh(1, 1, 1))
    return policy, load_params(init_from, state)









def run_profile(args) -> int:
    """``--mode profile``: one rollout worker's ``T(tokens, batch)`` derived from the engine's
    pass-cost profile, checked against whole ``generate`` calls, and saved for the planner.

    One engine as the trainer builds it (``assembly.make_engine`` with the config's ``rollout``
    section) but with ``eos_ids=()``, so every sequence generates exactly ``tokens`` new tokens.
    The model is ``CostModel.from_pass_cost`` of the engine's pass-cost profile (what a goodput
    run uses: ``spec.step_cost``, else this machine's cached profile, profiled now when there is
    none), with the mean prompt length of the profile's prompts as each sequence's prefill. The
    grid (``_measure_grid``) times GRPO-shaped batches for the check, and its own least-squares
    fit is reported beside it; the saved file holds the pass-cost model.
    """
    import jax

    from rhyme_jax.parallel.reshard import reshard
    from rhyme_jax.parallel.rules import param_shardings
    from rhyme_jax.rollout.engine import SamplingParams
    from rhyme_jax.train.assembly import make_engine

    t_start = time.perf_counter()
    _require_params(args.init_from)
    _enable_compile_cache(args.jax_cache)
    pol, params = load_policy(args.config, args.overrides, args.init_from, args.run_dir)
    cfg, r = pol.cfg, pol.cfg.rollout
    engine = make_engine(pol.graphdef, pol.model_cfg, cfg, (), mesh=None)  # no EOS: exact lengths
    state = reshard(params, param_shardings(params, engine.mesh))
    n = int(cfg.grpo.samples_per_prompt)
    dev = jax.devices()[0]
    pass_cost = engine.use_pass_cost(state, SamplingParams.from_section(r), cfg.spec.step_cost)
    prompts = [pol.prompt_tokens(i) for i in range(-(-r.max_slots // n))]
    prompt_tokens = float(np.mean([len(p) for p in prompts]))
    cm = CostModel.from_pass_cost(pass_cost, prompt_tokens)
    samples, compile_s = _measure_grid(engine, state, pol, args, n, dev)
    rows = check_rows(cm, samples)
    grid_cm, grid_rows = fit_report(samples)
    print()
    print(format_profile_table(cm, rows, source=f"From the pass-cost profile ({len(pass_cost.seconds)} programs)"))
    print()
    print(format_profile_table(grid_cm, grid_rows, source="The grid's own fit (for comparison)"))
    out = Path(args.out or "benchmarks/results/cost_model.json")
    meta = {"source": "python -m benchmarks.schedule --mode profile: CostModel.from_pass_cost",
            "pass_cost": {"programs": len(pass_cost.seconds), **pass_cost.meta}, "prompt_tokens": prompt_tokens,
            "platform": dev.platform, "device_kind": dev.device_kind, "jax_version": jax.__version__,
            "init_from": str(args.init_from), "config": str(args.config), "overrides": list(args.overrides),
            "model": {k: int(getattr(pol.model_cfg, k)) for k in
                      ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")},
            "rollout": {"max_slots": int(r.max_slots), "page_size": int(r.page_size),
                        "max_new_tokens": int(r.max_new_tokens), "attention_impl": engine.attention_impl,
                        "temperature": float(r.temperature)},
            "samples_per_prompt": n, "repeats": int(args.repeats),
            "samples": [[int(t), int(b), float(s)] for t, b, s in samples],
            "rel_error": [r_["rel_error"] for r_ in rows],
            "grid_fit": {"a": grid_cm.a, "b": grid_cm.b, "c": grid_cm.c,
                         "rel_error": [r_["rel_error"] for r_ in grid_rows]},
            "warmup_s": compile_s, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    cm.save(out, meta=meta)
    print(f"\nwrote {out} ({time.perf_counter() - t_start:.0f} s in all); use it with "
          f"`--set sched.cost_model={out}` (trainer) or `--cost-model {out}` (python -m benchmarks.schedule)")
    return 0


def _measure_grid(engine, state, pol, args, n: int, dev) -> tuple[list[tuple[int, int, float]], dict]:
    """``(tokens, batch, seconds)`` of whole ``generate`` calls over ``profile_grid``: per grid
    point ``ceil(batch / n)`` train prompts with ``n`` samples each (prompt-prefix sharing as in
    training), one warm-up call (compiles the shapes it needs), then the median wall time of
    ``args.repeats`` calls with fresh keys. Returns the samples and the warm-up seconds per point.

    Raises:
      RuntimeError: a call generated other than ``batch * tokens`` tokens.
    """
    import jax

    from rhyme_jax.rollout.batching import seq_buckets
    from rhyme_jax.rollout.engine import SamplingParams

    r = pol.cfg.rollout
    batches, tokens = profile_grid(r.max_slots, r.max_new_tokens)
    print(f"HistoPipe profile check: one rollout worker on {dev.platform} ({dev.device_kind}), params "
          f"{args.init_from}; batches {batches} (decode row buckets {list(seq_buckets(r.max_slots))}), tokens "
          f"{tokens}, median of {args.repeats} timed calls after one warm-up per shape", flush=True)
    key = jax.random.key(args.seed)
    samples, compile_s = [], {}
    for b in batches:
        prompts = [pol.prompt_tokens(i) for i in range(-(-b // n)) for _ in range(n)][:b]
        for t in tokens:
            sp = SamplingParams.from_section(r, max_new_tokens=t)
            t0 = time.perf_counter()
            out = engine.generate(state, prompts, sp, key)
            compile_s[f"{b}x{t}"] = time.perf_counter() - t0
            got = int(out.stats["generated_tokens"])
            if got != b * t:
                raise RuntimeError(f"profile: batch {b} x {t} tokens generated {got} tokens, expected {b * t} "
                                   f"(eos_ids=() should make every sequence run to max_new_tokens)")
            times = []
            for rep in range(args.repeats):
                t0 = time.perf_counter()
                engine.generate(state, prompts, sp, jax.random.fold_in(key, rep + 1))
                times.append(time.perf_counter() - t0)
            med = float(np.median(times))
            samples.append((t, b, med))
            print(f"  batch {b:3d} tokens {t:3d}: warm-up {compile_s[f'{b}x{t}']:6.2f} s, median {med:.4f} s "
                  f"({b * t / med:7.0f} tok/s; runs {', '.join(f'{x:.4f}' for x in times)})", flush=True)
    return samples, compile_s


def warm_up(engines, states, sampling, *, threads: int = 0) -> list[float]:
    """Compile every step shape of every engine (``engine.warmup(state, sampling,
    draft_buckets=(0,))``) before anything is timed; returns the seconds per engine.

    Each engine sits on its own device, so XLA compiles its programs separately (the persistent
    cache makes later runs cheap). Compilation is mostly single-threaded, so engines are warmed up
    ``threads`` at a time (0 = one per host CPU core, at most one per engine).
    """
    from concurrent.futures import ThreadPoolExecutor

    def one(w):
        t0 = time.perf_counter()
        shapes = engines[w].warmup(states[w], sampling, draft_buckets=(0,))
        dt = time.perf_counter() - t0
        print(f"  warm-up worker {w}: {shapes} step shapes compiled in {dt:.1f} s", flush=True)
        return dt

    n = max(1, min(len(engines), threads or os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="warmup") as pool:
        return list(pool.map(one, range(len(engines))))




def cross_step_chain(sch, batches, pol, states, sampling, cfg, *, train_s: float) -> tuple[list[dict], dict]:
    """The steps of ``batches`` through cross-step worker queues as the trainer drives them:
    steps 1 and 2 queued at once; then for each step, collect it, wait ``train_s`` seconds (the
    update, simulated by a sleep: the CPU is not used; recorded with ``record_update`` as the
    trainer records its update), queue step s + 2. Same weights throughout
    (no training). Returns the per-step rows (the ``WORKER_METRICS`` of each step's timeline
    window; ``wall_s`` = the window) and the intervals by step."""
    import jax

    def submit(i):
        st, hist = batches[i]
        n = int(st.lengths.shape[1])
        prompts = [pol.prompt_tokens(int(p)) for p in st.prompt_ids for _ in range(n)]
        key = jax.random.fold_in(jax.random.key(cfg.run.seed), st.step)
        return sch.submit(st.step, states, st.prompt_ids, prompts, n, sampling, key, history=hist, queued=True)

    pending = [submit(i) for i in range(min(2, len(batches)))]
    rows, ivs = [], {}
    for i, (st, _) in enumerate(batches):
        sr = sch.collect(pending.pop(0))
        rows.append(step_row(st.step, sr, float(sr.metrics["time/rollout_makespan_s"])))
        ivs[st.step] = sr.intervals
        t0 = time.perf_counter()
        time.sleep(train_s)
        sch.record_update(t0, time.perf_counter())  # as the trainer does: the update's time is busy
        if i + 2 < len(batches):
            pending.append(submit(i + 2))
    return rows, ivs


def run_workers_mode(args) -> int:
    """``--mode workers``: the four configurations on W real rollout workers.

    W engines on ``rollout_meshes(1, W)`` (one device each; ``assembly.build_rollout``), the params
    resharded into each worker's layout, every engine warmed up (compiled) before timing. For each
    step of ``--start-step .. + --steps`` of ``--run-dir``'s saved rollouts: that step's prompts
    (n samples each, prompt ids as the trainer built them), the predictions from each prompt's
    previous occurrence (``worker_steps``), the trainer's key for the step; every configuration of
    ``WORKER_CONFIGS`` runs ``RolloutScheduler.rollout`` on the same inputs (configurations
    interleaved per step, so drift of the machine hits all alike). No HistoSpec drafter: only the
    scheduling differs. Then each of ``CROSS_STEP_CONFIGS`` runs the same steps chained through
    cross-step worker queues (``cross_step_chain``; the update between steps is a sleep of
    ``--train-share`` of a step at fifo's median makespan). Medians over the steps go to a
    markdown table and JSON.
    """
    import jax

    W = int(args.workers)
    if jax.device_count() < W:
        raise BenchSetupError(
            f"--mode workers --workers {W} needs {W} devices (one per worker); JAX sees {jax.device_count()} "
            f"({jax.default_backend()}). On CPU start it with one fake device per worker:\n"
            f"  XLA_FLAGS=--xla_force_host_platform_device_count={W} python -m benchmarks.schedule --mode workers "
            f"--workers {W}")
    if args.cost_model:
        CostModel.load(args.cost_model)  # fail early on a bad file
    t_start = time.perf_counter()
    batches = worker_steps(args.run_dir, args.start_step, args.steps)  # fail before building anything
    _require_params(args.init_from)
    _enable_compile_cache(args.jax_cache)
    bench = _WorkersBench.build(args, W, [st.step for st, _ in batches])
    try:
        per_step, intervals = bench.interleaved(batches)
        fifo_span = float(np.median([r["time/rollout_makespan_s"] for r in per_step["fifo"]]))
        train_s = args.train_share / (1.0 - args.train_share) * fifo_span
        for name in CROSS_STEP_CONFIGS:
            per_step[name], intervals[name] = bench.chained(name, batches, train_s)
    finally:
        bench.close()
    _write_workers(args, bench, batches, per_step, intervals, train_s, t_start)
    return 0


@dataclass
class _WorkersBench:
    """The workers mode's set-up: policy, rollout parts (W engines, one device each), the params
    in each worker's layout, the sampling settings and one scheduler per ``WORKER_CONFIGS`` entry."""

    args: object
    policy: object
    rollout: object
    states: list
    sampling: object
    scheds: dict
    warm: list
    cost_src: str

    @classmethod
    def build(cls, args, W: int, steps: list[int]) -> "_WorkersBench":
        """Policy, W one-device engines and their params, one scheduler per ``WORKER_CONFIGS``
        entry, every engine warmed up (``warm_up``). Raises ``BenchSetupError`` as ``load_policy``."""
        import jax

        from rhyme_jax.parallel.mesh import rollout_meshes
        from rhyme_jax.rollout.engine import SamplingParams
        from rhyme_jax.train.assembly import build_rollout

        policy, params = load_policy(args.config, args.overrides, args.init_from, args.run_dir)
        cfg, r = policy.cfg, policy.cfg.rollout
        meshes = rollout_meshes(1, W)
        parts = build_rollout(cfg, policy, params, meshes=meshes)
        states = parts.states(params)
        sampling = SamplingParams.from_section(r)
        scheds = {name: cls.scheduler(args, parts, sets) for name, sets in WORKER_CONFIGS.items()}
        cost = next(iter(scheds.values())).cost_model
        cost_src = args.cost_model or cfg.sched.cost_model or "placeholder defaults"
        print(f"HistoPipe workers: W={W} engines on {jax.default_backend()} devices "
              f"{[m.devices.ravel()[0].id for m in meshes]} ({os.cpu_count()} host CPU cores), params "
              f"{args.init_from}, steps {steps} of {args.run_dir}, temperature {r.temperature}, "
              f"max_new_tokens {r.max_new_tokens}; planner cost model a={cost.a:.4g} s, b={cost.b:.4g} s, "
              f"c={cost.c:.4g} s ({cost_src})", flush=True)
        t0 = time.perf_counter()
        warm = warm_up(parts.engines, states, sampling, threads=args.warmup_threads)
        print(f"  warm-up done in {time.perf_counter() - t0:.1f} s", flush=True)
        return cls(args, policy, parts, states, sampling, scheds, warm, cost_src)

    @staticmethod
    def scheduler(args, parts, sets: list[str]):
        """A ``RolloutScheduler`` over the rollout parts' engines with the config's ``sched``
        section under ``sets`` (and ``--cost-model``)."""
        from rhyme_jax.config import load_config
        from rhyme_jax.sched.scheduler import RolloutScheduler

        cm_set = [f"sched.cost_model={args.cost_model}"] if args.cost_model else []
        cfg = load_config(args.config, [*args.overrides, *sets, *cm_set])
        return RolloutScheduler(parts.engines, cfg.sched, cfg.rollout.max_new_tokens)

    def interleaved(self, batches) -> tuple[dict, dict]:
        """Every ``WORKER_CONFIGS`` scheduler on each step of ``batches`` in turn; returns the
        per-step rows and the intervals by configuration."""
        import jax

        cfg, max_new = self.policy.cfg, self.sampling.max_new_tokens
        per_step: dict[str, list[dict]] = {name: [] for name in self.scheds}
        intervals: dict[str, dict[int, list]] = {name: {} for name in self.scheds}
        for st, hist in batches:
            ids, n = st.prompt_ids, int(st.lengths.shape[1])
            prompts = [self.policy.prompt_tokens(int(i)) for i in ids for _ in range(n)]
            key = jax.random.fold_in(jax.random.key(cfg.run.seed), st.step)
            pred = predict_lengths(hist, ids, cfg.sched.length_stat, default=max_new / 2)
            seen = sum(int(p) in hist for p in ids.tolist())
            print(f"step {st.step}: {len(ids)} prompts x {n} samples, {seen} with history; prediction vs the "
                  f"demo run's own lengths at this step: r = {corr(pred, st.lengths.mean(1)):.2f}", flush=True)
            for name, sch in self.scheds.items():
                t0 = time.perf_counter()
                sr = sch.rollout(st.step, self.states, ids, prompts, n, self.sampling, key, history=hist)
                wall = time.perf_counter() - t0
                lengths = np.array([len(t) for t in sr.result.tokens])
                row = step_row(st.step, sr, wall, prediction_corr=corr(pred, lengths.reshape(-1, n).mean(1)))
                per_step[name].append(row)
                intervals[name][st.step] = sr.intervals
                print(f"  {name:22s} bubble {row['sched/bubble_fraction']:6.1%}  earliest-finisher idle "
                      f"{row['sched/earliest_finisher_idle']:6.1%}  makespan {row['time/rollout_makespan_s']:6.3f} s  "
                      f"migrated {row['sched/migrated_share']:5.1%}  rows/worker {row['worker_rows']}  "
                      f"mean length {row['mean_length']:.1f} (r vs prediction {row['prediction_corr']:.2f})",
                      flush=True)
        return per_step, intervals

    def chained(self, name: str, batches, train_s: float) -> tuple[list[dict], dict]:
        """The ``CROSS_STEP_CONFIGS`` entry ``name`` over ``batches`` (``cross_step_chain``)."""
        sch = self.scheduler(self.args, self.rollout, CROSS_STEP_CONFIGS[name])
        try:
            rows, ivs = cross_step_chain(sch, batches, self.policy, self.states, self.sampling, self.policy.cfg,
                                         train_s=train_s)
        finally:
            sch.close()
        for row in rows:
            print(f"  {name:22s} step {row['step']}: bubble {row['sched/bubble_fraction']:6.1%}  earliest-finisher "
                  f"idle {row['sched/earliest_finisher_idle']:6.1%}  window {row['time/rollout_makespan_s']:6.3f} s",
                  flush=True)
        return rows, ivs

    def close(self) -> None:
        """Stop the schedulers' and the rollout parts' threads."""
        for sch in self.scheds.values():
            sch.close()
        self.rollout.close()


def _write_workers(args, bench: _WorkersBench, batches, per_step, intervals, train_s: float, t_start: float) -> None:
    """The workers mode's table (printed), JSON and markdown (and Gantt PNGs with ``--gantt``)."""
    import jax

    W, cfg = int(args.workers), bench.policy.cfg
    r = cfg.rollout
    cost = next(iter(bench.scheds.values())).cost_model
    summary = summarize_workers(per_step)
    table = format_workers_table(summary)
    print(f"\nMedians over {len(batches)} steps (W={W}; wall-clock on {os.cpu_count()} host cores shared by "
          f"the W worker threads):\n")
    print(table)
    out = Path(args.out or "benchmarks/results/schedule_workers.json")
    doc = {"settings": {"workers": W, "steps": [st.step for st, _ in batches], "run_dir": str(args.run_dir),
                        "init_from": str(args.init_from), "config": str(args.config),
                        "overrides": list(args.overrides), "platform": jax.default_backend(),
                        "device_kind": jax.devices()[0].device_kind, "host_cpus": os.cpu_count(),
                        "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax_version": jax.__version__,
                        "cost_model": {"a": cost.a, "b": cost.b, "c": cost.c, "source": bench.cost_src},
                        "sampling": {"temperature": float(r.temperature), "max_new_tokens": int(r.max_new_tokens)},
                        "length_stat": cfg.sched.length_stat, "growth": float(cfg.sched.growth),
                        "tail_fraction": float(cfg.sched.tail_fraction),
                        "configs": {**WORKER_CONFIGS, **CROSS_STEP_CONFIGS}, "warmup_s": bench.warm,
                        "cross_step_train_s": train_s,
                        "total_s": time.perf_counter() - t_start},
           "summary": summary, "per_step": per_step}
    with atomic_write(out, "w") as fh:
        json.dump(doc, fh, indent=1)
    with atomic_write(out.with_suffix(".md"), "w") as fh:
        fh.write(table + "\n")
    print(f"\nwrote {out} and {out.with_suffix('.md')} ({time.perf_counter() - t_start:.0f} s in all)")
    if args.gantt:
        for name in ("fifo", WORKER_FULL, *CROSS_STEP_CONFIGS):
            png = out.with_name(f"{out.stem}_gantt_{name.replace('+', '_').replace(' ', '_')}.png")
            plot_gantt(intervals[name], png, num_workers=W, title=f"{name} ({W} real workers)")
            print(f"wrote {png}")
