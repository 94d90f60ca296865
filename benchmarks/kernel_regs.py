"""Registers and spills of the compiled GPU attention kernel, per dtype, ``block_q`` and query length
(issue 50: the f32 kernel with 64 query rows used 255 registers a thread and spilled).

Each variant (SmolLM2-135M's heads: H 9, KVH 3, hd 64, page 16) is jitted under its own name and
compiled by XLA with ``--xla_dump_to``; the PTX XLA dumps is assembled with ``ptxas -v`` for its
target and the register / spill / stack lines of each entry function are read back. The variant
``default_block_sizes`` picks is the check: exit 1 when one of those spills. The other variants are
reported for tuning.

Usage (GPU)::

    python -m benchmarks.kernel_regs --out /tmp/kregs            # kernel_regs.json / .md

``--lower-only`` (CPU smoke) lowers every variant for CUDA (Triton's tile rules) and stops there:
assembling needs the GPU compiler.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DTYPES = ("float32", "bfloat16")
BLOCK_Q = (16, 32, 64)
Q_LENS = (1, 4, 9)  # decode; verify programs' max_q_len (SmolLM2 runs: 3-9)


def parse_ptxas(text: str) -> dict[str, dict]:
    """``ptxas -v`` output -> ``{entry function: {registers, spill_stores, spill_loads, stack}}``
    (bytes for the last three)."""
    out: dict[str, dict] = {}
    name = None
    for line in text.splitlines():
        m = re.search(r"Function properties for (\S+)", line) or re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            name = m.group(1)
            out.setdefault(name, {})
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            out[name].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            out[name]["registers"] = int(m.group(1))
    return out


def find_ptxas() -> str | None:
    """``ptxas`` on PATH, in CUDA's usual prefix, or the one Triton's wheel carries."""
    found = shutil.which("ptxas") or next(iter(glob.glob("/usr/local/cuda*/bin/ptxas")), None)
    if found:
        return found
    try:
        import triton
        cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
        return str(cand) if cand.exists() else None
    except ImportError:
        return None


def _variant(dtype: str, block_q: int, q_len: int, lower_only: bool, dump: str):
    """Compile (or lower for CUDA) one variant; returns the jitted function's name."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.ragged_paged_attention import pallas_gpu

    s, h, kvh, hd, ps, pps, pages = 8, 9, 3, 64, 16, 16, 129
    name = f"kregs_{dtype}_bq{block_q}_q{q_len}"
    bs = pallas_gpu.GPUBlockSizes(block_q=block_q)

    def fn(q, k, v, kv_lens, page_indices, cu, n):
        return pallas_gpu.ragged_paged_attention(q, k, v, kv_lens, page_indices, cu, n, sm_scale=0.125,
                                                 max_q_len=q_len, block_sizes=bs)

    fn.__name__ = fn.__qualname__ = name
    dt = jnp.dtype(dtype)
    args = [jax.ShapeDtypeStruct((s * q_len, h, hd), dt), jax.ShapeDtypeStruct((kvh, pages, ps, hd), dt),
            jax.ShapeDtypeStruct((kvh, pages, ps, hd), dt), jax.ShapeDtypeStruct((s,), jnp.int32),
            jax.ShapeDtypeStruct((s, pps), jnp.int32), jax.ShapeDtypeStruct((s + 1,), jnp.int32),
            jax.ShapeDtypeStruct((1,), jnp.int32)]
    traced = jax.jit(fn).trace(*args)
    if lower_only:
        assert "triton" in traced.lower(lowering_platforms=("cuda",)).as_text()
    else:
        traced.lower().compile()
    return name


def _registers(name: str, dump: str, ptxas: str) -> dict:
    files = sorted(glob.glob(os.path.join(dump, f"*{name}*.ptx")))
    if not files:
        return {"error": f"no PTX dumped for {name} under {dump}"}
    funcs = {}
    for f in files:
        text = Path(f).read_text()
        arch = re.search(r"^\.target\s+(\w+)", text, re.M)
        proc = subprocess.run([ptxas, "-v", f"-arch={arch.group(1) if arch else 'sm_90a'}", f, "-o", os.devnull],
                              capture_output=True, text=True)
        funcs.update(parse_ptxas(proc.stdout + proc.stderr))
    kernel = {k: v for k, v in funcs.items() if "ragged" in k or "triton" in k} or funcs
    return {"functions": kernel, "ptx": [os.path.basename(f) for f in files]}


def main(argv=None) -> int:
    """Command line (module docstring); exit 1 when a default tiling spills, 3 when nothing could
    be read (no PTX or no ptxas)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--lower-only", action="store_true", help="lower for CUDA only (CPU smoke)")
    args = ap.parse_args(argv)
    dump = tempfile.mkdtemp(prefix="kregs_")
    if not args.lower_only:  # before jax initialises its backend
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()
    import jax.numpy as jnp

    from pallas_kernels.ragged_paged_attention import api

    ptxas = None if args.lower_only else find_ptxas()
    rows, bad, unread = [], [], 0
    for dtype in DTYPES:
        for q_len in Q_LENS:
            default = api.default_block_sizes(q_len, jnp.dtype(dtype)).gpu.block_q
            for bq in BLOCK_Q:
                name = _variant(dtype, bq, q_len, args.lower_only, dump)
                row = dict(dtype=dtype, q_len=q_len, block_q=bq, default=bq == default)
                if ptxas:
                    row.update(_registers(name, dump, ptxas))
                    spills = [f for f, v in row.get("functions", {}).items() if v.get("spill_stores", 0) > 0]
                    unread += "functions" not in row
                    if spills and row["default"]:
                        bad.append(name)
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_regs.json").write_text(json.dumps(dict(ptxas=ptxas, rows=rows), indent=1))
    if args.lower_only:
        print(f"lowered {len(rows)} variants for CUDA; registers need the GPU compiler")
        return 0
    if ptxas is None or unread == len(rows):
        print(f"kernel_regs: nothing read (ptxas={ptxas}, dump {dump}: {os.listdir(dump)[:20]})", file=sys.stderr)
        return 3
    print(f"default tilings that spill: {bad or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
