"""``rhyme-jax compile-report``: the rollout step programs a run compiles, and what they cost.

Lists every program of ``rollout.shapes.programs_from_config`` (prefill, decode and, with
HistoSpec on, verify) and times the XLA compile of a sample of them with abstract weights: the
model is ``nnx.eval_shape``'d and the KV pool ``jax.eval_shape``'d, so each step is lowered for
``jax.ShapeDtypeStruct`` leaves and compiled (``jax.jit(...).lower(...).compile()``) without
allocating the model or the pool. The persistent compilation cache is not used (every sampled
program really compiles).

    rhyme-jax compile-report --config configs/gsm8k_qwen2.5_1.5b.yaml \\
        --model-config configs/models/qwen2.5-1.5b --sample 3 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import asdict
from typing import Any

from rhyme_jax.cli.common import add_command, load_run_config, user_errors
from rhyme_jax.config import RunConfig

DEFAULT_SAMPLE = 3


def register(sub) -> None:
    """Add ``compile-report`` to the ``rhyme-jax`` subparsers."""
    sp = add_command(sub, "compile-report", "the rollout step programs a run compiles, and the compile "
                     "time of a sample of them (abstract weights: nothing allocated)", run,
                     examples=("rhyme-jax compile-report --config configs/arith_smollm2_135m.yaml --sample 2",
                               "rhyme-jax compile-report --config configs/gsm8k_qwen2.5_1.5b.yaml "
                               "--model-config configs/models/qwen2.5-1.5b --json"))
    sp.add_argument("--model-config", default="", help="HF config.json (or its directory) of the "
                    "architecture; default: model.path's, else the tiny demo model")
    sp.add_argument("--sample", type=int, default=DEFAULT_SAMPLE,
                    help="programs to compile and time, spread over the kinds (default: %(default)s; 0 = none)")
    sp.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def sample_programs(programs: list, n: int) -> list:
    """``n`` programs spread over the kinds (round robin: verify, decode, prefill) and, within a
    kind, evenly over its sizes from the largest down."""
    by_kind = {k: sorted((p for p in programs if p.kind == k), key=lambda p: (p.tokens, p.q_len, p.width))
               for k in ("verify", "decode", "prefill")}
    by_kind = {k: v for k, v in by_kind.items() if v}
    counts = Counter()
    kinds = list(by_kind)
    for i in range(min(n, len(programs))):
        for j in range(len(kinds)):
            k = kinds[(i + j) % len(kinds)]
            if counts[k] < len(by_kind[k]):
                counts[k] += 1
                break
    out = []
    for k, c in counts.items():
        items = by_kind[k]
        idx = sorted({len(items) - 1 - round(i * (len(items) - 1) / max(c - 1, 1)) for i in range(c)})
        out += [items[i] for i in idx]
    return out


def _abstract_engine(cfg: RunConfig, model_cfg):
    """``(engine, abstract state)``: the run's engine over an ``nnx.eval_shape``'d model in the
    rollout dtype (``rollout.dtype``, else ``model.dtype``) with an abstract KV pool."""
    from flax import nnx

    from rhyme_jax.model.transformer import Decoder
    from rhyme_jax.train.policy import rollout_dtype
    from rhyme_jax.train.assembly import make_engine

    dtype = rollout_dtype(cfg)
    abstract = nnx.eval_shape(lambda: Decoder(model_cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    engine = make_engine(graphdef, model_cfg, cfg, (0,))
    engine.kv = engine.abstract_pool(state)
    return engine, state


def compile_seconds(engine, state, program, sampling) -> float:
    """Seconds to lower and XLA-compile one step program of ``engine`` (abstract arguments)."""
    from rhyme_jax.rollout.pass_runner import PassRunner

    runner = PassRunner(engine, state, sampling, allocate=False)  # the engine holds an abstract pool
    inp = runner.inputs(program)
    t0 = time.perf_counter()
    runner.lower(inp).compile()
    return time.perf_counter() - t0


def report(cfg: RunConfig, model_config: str, sample: int) -> dict[str, Any]:
    """What ``rhyme-jax compile-report`` prints: ``programs`` (count), ``by_kind``, ``shapes``
    (every program), ``sampled`` (the timed ones, each with ``compile_s``) and
    ``sample_compile_s`` (their seconds, in the same order)."""
    import jax

    from rhyme_jax.train.memory_plan import model_config_of
    from rhyme_jax.rollout.engine import SamplingParams
    from rhyme_jax.rollout.shapes import plan_from_config, programs_from_config

    programs = programs_from_config(cfg)
    model_cfg, source = model_config_of(cfg, model_config)
    sampling = SamplingParams.from_section(cfg.rollout)
    picked = sample_programs(programs, max(0, sample))
    timed = []
    if picked:
        engine, state = _abstract_engine(cfg, model_cfg)
        timed = [dict(asdict(p), compile_s=round(compile_seconds(engine, state, p, sampling), 3)) for p in picked]
    plan = plan_from_config(cfg)
    return {
        "model": source, "layers": model_cfg.num_layers, "dtype": str(cfg.rollout.dtype or cfg.model.dtype),
        "spec": bool(cfg.spec.enabled), "backend": jax.default_backend(),
        "programs": len(programs), "by_kind": dict(Counter(p.kind for p in programs)),
        "row_buckets": sorted({p.rows for p in programs if p.kind != "prefill"}),
        "widths": list(plan.widths), "verify_budget": plan.verify_budget, "prefill_budget": plan.prefill_budget,
        "shapes": [asdict(p) for p in programs],
        "sampled": timed, "sample_compile_s": [t["compile_s"] for t in timed],
    }


def print_report(rep: dict[str, Any]) -> None:
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(rep["by_kind"].items()))
    print(f"rollout step programs: {rep['programs']} ({kinds}); HistoSpec {'on' if rep['spec'] else 'off'}; "
          f"model {rep['model']} ({rep['layers']} layers, {rep['dtype']})")
    print(f"{'kind':8s} {'tokens':>7s} {'rows':>5s} {'q_len':>6s} {'width':>6s}  compile")
    timed = {(t["kind"], t["tokens"], t["rows"], t["q_len"], t["width"]): t["compile_s"] for t in rep["sampled"]}
    for p in rep["shapes"]:
        key = (p["kind"], p["tokens"], p["rows"], p["q_len"], p["width"])
        c = f"{timed[key]:.2f} s" if key in timed else ""
        print(f"{p['kind']:8s} {p['tokens']:7d} {p['rows']:5d} {p['q_len']:6d} {p['width']:6d}  {c}")
    if rep["sampled"]:
        s = rep["sample_compile_s"]
        print(f"sampled {len(s)} on {rep['backend']}: mean {sum(s) / len(s):.2f} s, max {max(s):.2f} s per program")


def run(args: argparse.Namespace) -> int:
    """Run ``rhyme-jax compile-report``; returns the exit status."""
    if args.sample < 0:
        print("rhyme-jax compile-report: --sample must be >= 0", file=sys.stderr)
        return 2
    cfg = load_run_config(args)
    if cfg is None:
        return 2
    try:
        rep = report(cfg, args.model_config, args.sample)
    except user_errors() as exc:
        print(f"rhyme-jax compile-report: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rep))
    else:
        print_report(rep)
    return 0
