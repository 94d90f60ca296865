"""Ragged paged attention kernel benchmark (issue 3): decode and verify shapes of an 8B-class model.

Times one layer of ``ragged_paged_attention`` (32 query heads, 8 KV heads, head_dim 128, bf16) on
a paged KV pool, for every (batch, context, page size, q_len) of the sweep and every
implementation available on the backend:

* GPU: ``pallas_gpu`` (our Triton kernel), ``reference`` (jnp oracle) and, for q_len 1,
  ``jax_paged_attention`` (JAX's own decode kernel, ``jax.experimental.pallas.ops.gpu``; same
  pool layout, its page table padded to whole ``k_splits`` partitions outside the timed region);
* TPU: ``pallas_tpu`` and ``reference``; CPU: ``reference`` (``--quick`` shapes).

``context`` is ``kv_len`` (cached tokens including the new ones), so decode (q_len 1) and verify
(q_len 9 = K 8 drafts + 1) read the same K/V bytes. Each sequence's pages are distinct and
shuffled over a pool of exactly ``batch * pages_per_seq + 1`` pages (page 0 is scratch), filled
with random normal values (never zeros). Timing: ``jax.jit`` + ahead-of-time compile (reported
apart), warm-up runs, then the median of ``--iters`` wall-clock runs each ended by
``block_until_ready``; ``pipelined`` is the mean of ``--iters`` back-to-back calls with one sync
(launch gaps hidden). Achieved HBM bandwidth = (sum(kv_len) * KVH * hd * 2 (K and V) + 2 * T * H
* hd) * dtype bytes / median time, also as % of ``--hbm-tbps`` (default by device kind).

Correctness guard: before timing an implementation on a shape, its output rows of the first
``--check-seqs`` sequences are compared with the reference run on those sequences alone; beyond
the bf16 tolerance (or NaN) the implementation is marked FAILED and not timed.

Usage::

    python -m benchmarks.kernels                    # full sweep, default backend
    python -m benchmarks.kernels --quick            # CPU smoke (< 1 min)
    python -m benchmarks.kernels --check-only       # kernel vs reference + engine greedy equality

Writes ``kernels.json`` and ``kernels.md`` under ``--out`` after every measurement (a budget or
kill leaves the partial results), and prints the table.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import jax

from rhyme_lab.bench.kernel_report import HEADER, fmt_opt, fmt_row, targets_title, write_results
from rhyme_lab.bench.kernels import DEFAULT_IMPLS, TOL, copy_bandwidth_tbps, default_hbm_tbps, resolve_impls, run_sweep

RESULTS = Path(__file__).resolve().parent / "results"


# ----------------------------------------------------------------------------- CLI
def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--batch", type=_ints, default=None, help="default 64,128,256 (--quick: 2,4)")
    ap.add_argument("--context", type=_ints, default=None,
                    help="kv_len per sequence; default 2048,4096,8192,16384 (--quick: 128,256)")
    ap.add_argument("--page-size", type=_ints, default=None, help="default 16,64 (--quick: 16)")
    ap.add_argument("--q-len", type=_ints, default=[1, 9], help="1 = decode, 9 = verify of K=8 drafts")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(TOL), default="bfloat16")
    ap.add_argument("--len-spread", type=float, default=0.0,
                    help="kv_len uniform in [context*(1-spread), context]; 0 = all equal")
    ap.add_argument("--impls", default=None, help="comma list; default by backend " + str(DEFAULT_IMPLS))
    ap.add_argument("--variant", action="append", default=[], metavar="KERNEL:FIELD=V,...",
                    help="extra block-size variant, e.g. pallas_gpu:block_q=64 (repeatable)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--check-seqs", type=int, default=8, help="sequences compared with the reference")
    ap.add_argument("--ref-max-tokens", type=int, default=1 << 21,
                    help="time the reference only when batch*context <= this (memory, time)")
    ap.add_argument("--hbm-tbps", type=float, default=None, help="roofline; default by device kind")
    ap.add_argument("--no-copy-probe", action="store_true", help="skip the device copy bandwidth probe")
    ap.add_argument("--max-seconds", type=float, default=0.0, help="stop starting new work after this; 0 = none")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--quick", action="store_true",
                    help="tiny shapes for a CPU smoke run (batch 2,4; context 128,256; page 16)")
    ap.add_argument("--check-only", action="store_true",
                    help="correctness only: kernel vs reference on ragged random cases + engine greedy equality")
    ap.add_argument("--kernel-impl", default=None,
                    help="--check-only: implementation checked (default pallas_gpu / pallas_tpu / "
                         "pallas_gpu_interpret on CPU)")
    ap.add_argument("--max-cases", type=int, default=0, help="--check-only: first N ragged cases; 0 = all")
    ap.add_argument("--engine-new-tokens", type=int, default=24, help="--check-only: greedy tokens per prompt")
    ap.add_argument("--no-engine", action="store_true", help="--check-only: skip the engine check")
    args = ap.parse_args(argv)
    full = dict(batch=[64, 128, 256], context=[2048, 4096, 8192, 16384], page_size=[16, 64])
    quick = dict(batch=[2, 4], context=[128, 256], page_size=[16])
    for name, val in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, val)
    if args.quick:
        args.iters, args.warmup = min(args.iters, 5), min(args.warmup, 1)
    for name in ("iters", "warmup", "check_seqs", "heads", "kv_heads", "head_dim"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("batch", "context", "page_size", "q_len"):
        vals = getattr(args, name)
        if not vals or min(vals) < 1:
            ap.error(f"--{name.replace('_', '-')} needs positive integers, got {vals}")
    if max(args.q_len) > min(args.context):
        ap.error(f"--q-len {max(args.q_len)} exceeds the smallest --context {min(args.context)}")
    if not 0.0 <= args.len_spread < 1.0:
        ap.error(f"--len-spread must be in [0, 1), got {args.len_spread}")
    if args.heads % args.kv_heads:
        ap.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.check_only:
        from rhyme_lab.bench.kernel_checks import run_checks

        return run_checks(args)
    backend = jax.default_backend()
    device_kind = jax.devices()[0].device_kind
    try:
        impls = resolve_impls(args, backend)
    except ValueError as exc:
        print(f"python -m benchmarks.kernels: {exc}", file=sys.stderr)
        return 2
    hbm = args.hbm_tbps if args.hbm_tbps is not None else default_hbm_tbps(device_kind)
    meta = dict(backend=backend, device_kind=device_kind, jax=jax.__version__, python=platform.python_version(),
                hbm_tbps=hbm, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype,
                iters=args.iters, warmup=args.warmup, len_spread=args.len_spread, impls=[i for i, _ in impls],
                argv=sys.argv[1:] if argv is None else list(argv), status="running")
    if backend != "cpu" and not args.no_copy_probe:
        meta["copy_tbps"] = copy_bandwidth_tbps()
    print(f"{device_kind} ({backend}), jax {jax.__version__}, roofline {hbm} TB/s, "
          f"copy {fmt_opt(meta.get('copy_tbps'), '.2f')} TB/s, impls {meta['impls']}", flush=True)
    print(HEADER, flush=True)
    t0 = time.perf_counter()
    rows: list[dict] = []

    def emit(row):
        rows.append(row)
        if not row["status"].startswith(("SKIPPED", "n/a")):
            print(fmt_row(row), flush=True)
        write_results(args.out, meta, rows)

    run_sweep(args, impls, hbm, emit)
    skipped = sum(r["status"] == "SKIPPED(budget)" for r in rows)
    meta["status"] = f"finished in {time.perf_counter() - t0:.0f} s" + (
        f", {skipped} measurements skipped by --max-seconds" if skipped else "")
    summary = write_results(args.out, meta, rows)
    print("\n" + HEADER)
    for r in rows:
        if not r["status"].startswith(("SKIPPED", "n/a")):
            print(fmt_row(r))
    print(f"\n{targets_title(summary)}:")
    for name, e in summary["at_ratio_point"].items():
        print(f"  {name:<38} verify/decode {fmt_opt(e.get('verify_over_decode'), '.2f'):>5}   "
              f"decode % of roofline {fmt_opt(e['decode_pct_roofline'], '.1f'):>5}")
    print(f"{meta['status']}; wrote {args.out / 'kernels.json'} and {args.out / 'kernels.md'}")
    failed = [r for r in rows if r["status"].startswith(("FAILED", "ERROR"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
