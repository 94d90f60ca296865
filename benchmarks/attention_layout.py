"""Reference ragged paged attention: per-sequence vs per-token layout, one layer, per step shape.

``pallas_kernels/ragged_paged_attention/reference.py`` computes the same attention in two
layouts: per sequence (each sequence's pages gathered once, ``S x max_q_len`` padded query slots
scored) or per packed token (each token gathers its sequence's pages, ``T`` queries scored);
``token_layout(T, S, Q)`` picks one. This times both (jitted, median of ``--repeats``) on random
inputs for the decode / verify / prefill shapes of the demo's plan (S rows, T packed tokens, Q
``max_q_len``) and prints which one ``token_layout`` takes.

Usage::

    python -m benchmarks.attention_layout                       # demo model heads (4 / 2 x 32)
    python -m benchmarks.attention_layout --heads 9 --kv-heads 3 --head-dim 64 --pages-per-seq 24   # SmolLM2
"""

from __future__ import annotations

import argparse

import numpy as np

from rhyme_lab.bench.attention_layout import SHAPES, layout_ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pages-per-seq", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shapes", type=int, default=0, help="only the first N shapes (0 = all)")
    args = ap.parse_args(argv)

    import jax.numpy as jnp

    from pallas_kernels.ragged_paged_attention import reference as ref

    rng = np.random.default_rng(0)
    num_pages, ps = 2000, args.page_size
    kp = jnp.asarray(rng.standard_normal((args.kv_heads, num_pages, ps, args.head_dim)), jnp.float32)
    print(f"{'S':>4} {'T':>5} {'Q':>3}  per-sequence ms  per-token ms  token_layout")
    for s, t, q in SHAPES[: args.shapes or None]:
        ms = layout_ms(rng, kp, (s, t, q), heads=args.heads, pages_per_seq=args.pages_per_seq, repeats=args.repeats)
        pick = "token" if ref.token_layout(t, s, q) else "sequence"
        print(f"{s:>4} {t:>5} {q:>3}  {ms['sequence']:>15.2f}  {ms['token']:>12.2f}  {pick}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
