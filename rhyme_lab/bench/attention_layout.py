"""Reference ragged paged attention, per-sequence vs per-token layout, timed on one step shape
(``python -m benchmarks.attention_layout``; ``reference.token_layout`` picks between them).
"""

from __future__ import annotations

import numpy as np

from rhyme_lab.bench.kernels import wall_times

# (S rows, T packed tokens, Q max_q_len) of the demo's decode / verify / prefill plans
SHAPES = ((128, 128, 1), (128, 192, 7), (128, 320, 11), (128, 512, 17), (128, 4224, 33), (256, 2048, 16),
          (32, 32, 1), (32, 48, 7), (16, 24, 7), (16, 120, 31), (16, 528, 33), (8, 12, 5))


def layout_ms(rng: np.random.Generator, k_pages, shape: tuple[int, int, int], *, heads: int, pages_per_seq: int,
              repeats: int) -> dict[str, float]:
    """Median milliseconds (jitted, after one compile call, of ``repeats`` runs) of
    ``reference._attend_by_sequence`` and ``_attend_by_token`` on one step shape ``(S, T, Q)``.

    Args:
      rng: draws q ``float32[T, heads, hd]`` and the page table ``int32[S, pages_per_seq]``.
      k_pages: ``float32[KVH, num_pages, page_size, hd]``, used as K and V.
      shape: S sequences sharing T tokens as evenly as possible, ``max_q_len`` Q; every sequence
        has ``3 * page_size`` cached tokens before its new ones.

    Returns:
      ``{"sequence": ms, "token": ms}``.
    """
    import jax
    import jax.numpy as jnp

    from pallas_kernels.ragged_paged_attention import reference as ref

    s, t, q = shape
    kvh, num_pages, ps, hd = k_pages.shape
    q_lens = np.full(s, t // s)
    q_lens[: t - q_lens.sum()] += 1
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    args = (jnp.asarray(rng.standard_normal((t, heads, hd)), jnp.float32), k_pages, k_pages,
            jnp.asarray(q_lens + 3 * ps, jnp.int32),
            jnp.asarray(rng.integers(1, num_pages, (s, pages_per_seq)), jnp.int32),
            jnp.asarray(cu), jnp.asarray([s], jnp.int32))
    ms = {}
    for name, fn in (("sequence", ref._attend_by_sequence), ("token", ref._attend_by_token)):
        step = jax.jit(lambda *a, fn=fn: fn(*a, sm_scale=0.1, max_q_len=q, soft_cap=None, sliding_window=None))
        step(*args).block_until_ready()
        ms[name] = 1e3 * float(np.median(wall_times(step, args, repeats)))
    return ms
