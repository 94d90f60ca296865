"""This machine's bounds: read bandwidth, float32 matmul rates of XLA and torch, and the
weight-reading bound of a decode pass of the demo model and SmolLM2-135M (``rhyme_lab.bench.machine_bounds``).

Usage (repository root)::

    python -m benchmarks.machine_bounds                # 1 GiB read, the decode shapes, both models
    python -m benchmarks.machine_bounds --quick        # 64 MiB read, one shape, the demo model only

Prints a table and writes ``<out>/machine_bounds.json`` (default ``runs/bench_machine``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rhyme_jax.config import load_config
from rhyme_jax.train.memory_plan import model_config_of
from rhyme_jax.train.state_memory import state_memory
from rhyme_lab.bench.machine_bounds import machine_bounds

ROOT = Path(__file__).resolve().parents[1]
# decode-pass matmuls of SmolLM2-135M (hidden 576, MLP 1536) at 16, 32 and 128 rows
SHAPES = [(16, 576, 1536), (32, 576, 1536), (128, 576, 1536), (32, 1536, 576)]


def param_bytes(config: str) -> tuple[str, int]:
    """(model description, float32 parameter bytes) of a run config's model."""
    model_cfg, source = model_config_of(load_config(ROOT / "configs" / config, []), "")
    return source, int(state_memory(model_cfg, {}, param_dtype="float32")["param_bytes_total"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.machine_bounds", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 MiB read, one shape, the demo model only")
    ap.add_argument("--out", default="runs/bench_machine")
    args = ap.parse_args(argv)
    configs = ["default.yaml"] if args.quick else ["default.yaml", "arith_smollm2_135m.yaml"]
    models = dict(param_bytes(c) for c in configs)
    rep = machine_bounds(models, SHAPES[1:2] if args.quick else SHAPES,
                         bandwidth_bytes=(64 << 20) if args.quick else (1 << 30), repeats=3 if args.quick else 5)
    bw = rep["read_bandwidth"]
    print(f"{rep['cores']} cores; read bandwidth {bw['gb_per_s']:.1f} GB/s ({bw['bytes'] / 2**20:.0f} MiB)")
    for m in rep["matmul"]:
        rates = "  ".join(f"{e} {m[e].get('gflop_per_s', float('nan')):.1f} GFLOP/s" for e in ("xla", "torch") if e in m)
        print(f"  f32 matmul {m['shape']}: {rates}")
    for name, ms in rep["weight_read_ms"].items():
        print(f"  decode pass bound (weights read once) {name}: {ms:.2f} ms")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "machine_bounds.json").write_text(json.dumps(rep, indent=1))
    print(f"wrote {out / 'machine_bounds.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
