"""Reference ragged paged attention: per-sequence vs per-token layout, one layer, per step shape.

``pallas_kernels/ragged_paged_attention/reference.py`` computes the same attention in two
layouts: per sequence (each sequence's pages gathered once, ``S x max_q_len`` padded query slots
scored) or per packed token (each token gathers its sequence's pages, ``T`` queries scored);
``token_layout(T, S, Q)`` picks one. This times both (jitted, median of ``--repeats``) on random
inputs for the decode / verify / prefill shapes of the demo's plan (S rows, T packed tokens, Q
``max_q_len``) and prints which one ``token_layout`` takes.

Usage::

    python benchmarks/attention_layout.py                       # demo model heads (4 / 2 x 32)
    python benchmarks/attention_layout.py --heads 9 --kv-heads 3 --head-dim 64 --pages-per-seq 24   # SmolLM2
"""

from __future__ import annotations

import argparse
import time

import numpy as np

SHAPES = ((128, 128, 1), (128, 192, 7), (128, 320, 11), (128, 512, 17), (128, 4224, 33), (256, 2048, 16),
          (32, 32, 1), (32, 48, 7), (16, 24, 7), (16, 120, 31), (16, 528, 33), (8, 12, 5))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pages-per-seq", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from pallas_kernels.ragged_paged_attention import reference as ref

    rng = np.random.default_rng(0)
    num_pages, ps = 2000, args.page_size
    kp = jnp.asarray(rng.standard_normal((args.kv_heads, num_pages, ps, args.head_dim)), jnp.float32)
    print(f"{'S':>4} {'T':>5} {'Q':>3}  per-sequence ms  per-token ms  token_layout")
    for s, t, q in SHAPES:
        q_lens = np.full(s, t // s)
        q_lens[: t - q_lens.sum()] += 1
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        args_ = (jnp.asarray(rng.standard_normal((t, args.heads, args.head_dim)), jnp.float32), kp, kp,
                 jnp.asarray(q_lens + 3 * ps, jnp.int32),
                 jnp.asarray(rng.integers(1, num_pages, (s, args.pages_per_seq)), jnp.int32),
                 jnp.asarray(cu), jnp.asarray([s], jnp.int32))
        ms = {}
        for name, fn in (("sequence", ref._attend_by_sequence), ("token", ref._attend_by_token)):
            step = jax.jit(lambda *a, fn=fn, q=q: fn(*a, sm_scale=0.1, max_q_len=q, soft_cap=None,
                                                     sliding_window=None))
            step(*args_).block_until_ready()
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                step(*args_).block_until_ready()
                times.append(time.perf_counter() - t0)
            ms[name] = 1e3 * float(np.median(times))
        pick = "token" if ref.token_layout(t, s, q) else "sequence"
        print(f"{s:>4} {t:>5} {q:>3}  {ms['sequence']:>15.2f}  {ms['token']:>12.2f}  {pick}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
