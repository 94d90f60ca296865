"""A decode pass's matrix products in float32 and bfloat16, XLA against torch, on this machine.

For SmolLM2-135M's shapes at ``--rows`` rows (q, k/v, up, down projections and the tied head),
times one product at a time, median of ``--reps`` calls after one warm-up: XLA float32, XLA
bfloat16 with bfloat16 output, XLA bfloat16 accumulated in float32
(``preferred_element_type=float32``, what ``model.layers.dot_f32_accumulate`` does), torch float32
and torch bfloat16 (``torch.set_num_threads(cores)``). Says whether a bf16 rollout can gain on this
CPU and which product form XLA runs fast (docs/results.md, "bf16 rollouts on CPU: speed").

Usage (repository root; torch from the test extras)::

    python -m benchmarks.matmul_dtypes             # 32 rows
    python -m benchmarks.matmul_dtypes --rows 64 --reps 20
"""

from __future__ import annotations

import argparse
import os
import sys

from rhyme_lab.measure.timing import median_seconds

SHAPES = {"q": (576, 576), "kv": (576, 192), "up": (576, 1536), "down": (1536, 576), "head": (576, 49152)}


def _median_us(fn, reps: int) -> float:
    """Median microseconds of ``reps`` calls of ``fn`` after one untimed call."""
    return 1e6 * median_seconds(fn, reps, warmup=1)


def measure(rows: int, reps: int) -> dict[str, dict[str, float]]:
    """``{shape: {form: median us}}`` for every product of ``SHAPES`` at ``rows`` rows."""
    import jax
    import jax.numpy as jnp
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    plain = jax.jit(lambda a, b: a @ b)
    wide = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    out = {}
    for name, (k, n) in SHAPES.items():
        xa, xb = jnp.ones((rows, k), jnp.float32), jnp.ones((k, n), jnp.float32)
        ha, hb = xa.astype(jnp.bfloat16), xb.astype(jnp.bfloat16)
        ta, tb = torch.ones(rows, k), torch.ones(k, n)
        tha, thb = ta.bfloat16(), tb.bfloat16()
        out[name] = {
            "xla f32": _median_us(lambda: plain(xa, xb).block_until_ready(), reps),
            "xla bf16 out": _median_us(lambda: plain(ha, hb).block_until_ready(), reps),
            "xla bf16 f32-acc": _median_us(lambda: wide(ha, hb).block_until_ready(), reps),
            "torch f32": _median_us(lambda: ta @ tb, reps),
            "torch bf16": _median_us(lambda: tha @ thb, reps),
        }
    return out


def main(argv=None) -> int:
    """Command line (module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    res = measure(args.rows, args.reps)
    forms = list(next(iter(res.values())))
    print(f"{args.rows} rows, median us of {args.reps} calls")
    print("| product | " + " | ".join(forms) + " |")
    print("|---|" + "---|" * len(forms))
    for name, r in res.items():
        print(f"| {name} {SHAPES[name]} | " + " | ".join(f"{r[f]:.1f}" for f in forms) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
