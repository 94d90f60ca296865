"""Random ragged paged-attention batches: the cases of the kernel tests and of
``rhyme_lab.bench.kernel_checks`` (``python -m benchmarks.kernels --check-only``).

``random_case`` draws fresh q_lens / context lengths around the requested query lengths, with
KV lengths that cross page boundaries, padding sequences after ``num_seqs`` and trailing padding
rows, and pages of all sequences distinct, shuffled and never the scratch page 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

# atol = rtol of a kernel against ``reference`` (the reference at matmul precision "highest")
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


@dataclass
class RaggedCase:
    """Arguments of ``ragged_paged_attention`` as numpy arrays plus the static ``max_q_len``."""

    q: np.ndarray  # [T, H, hd]
    k_pages: np.ndarray  # [KVH, P, ps, hd]
    v_pages: np.ndarray
    kv_lens: np.ndarray  # i32[S]
    page_indices: np.ndarray  # i32[S, pps]
    cu_q_lens: np.ndarray  # i32[S+1]
    num_seqs: np.ndarray  # i32[1]
    max_q_len: int

    def args(self, dtype=jnp.float32):
        """Device arrays in the positional order of the op (q and pages cast to ``dtype``)."""
        return (jnp.asarray(self.q, dtype), jnp.asarray(self.k_pages, dtype), jnp.asarray(self.v_pages, dtype),
                jnp.asarray(self.kv_lens), jnp.asarray(self.page_indices), jnp.asarray(self.cu_q_lens),
                jnp.asarray(self.num_seqs))


def random_case(rng: np.random.Generator, q_lens, *, num_heads: int, num_kv_heads: int, head_dim: int,
                page_size: int, pages_per_seq: int, num_padding_seqs: int = 1,
                pad_rows: int = 3) -> RaggedCase:
    """A batch with the given per-sequence query lengths and random context lengths.

    Context lengths are drawn so that ``kv_len = ctx + q_len <= pages_per_seq * page_size``;
    ``num_padding_seqs`` extra rows follow the live ones (``cu_q_lens`` flat there, kv_lens 0);
    ``pad_rows`` query rows follow the last live token. Arrays are float32 (q ``[T, H, hd]``,
    pages ``[KVH, P, ps, hd]``, ``P = 1 + S * pages_per_seq``, page 0 unused) and int32 metadata.

    Raises:
      ValueError: a query length exceeds ``pages_per_seq * page_size``.
    """
    q_lens = [int(x) for x in q_lens]
    cap = pages_per_seq * page_size
    if max(q_lens) > cap:
        raise ValueError(f"q_len {max(q_lens)} exceeds the page-table capacity {cap}")
    ctx = [int(rng.integers(0, cap - q + 1)) for q in q_lens]
    live = len(q_lens)
    s = live + num_padding_seqs
    num_pages = 1 + s * pages_per_seq
    pages = rng.permutation(np.arange(1, num_pages)).reshape(s, pages_per_seq).astype(np.int32)
    kv_lens = np.zeros(s, np.int32)
    kv_lens[:live] = np.array(ctx) + np.array(q_lens)
    cu = np.zeros(s + 1, np.int32)
    cu[1: live + 1] = np.cumsum(q_lens)
    cu[live + 1:] = cu[live]
    t_total = int(cu[live]) + pad_rows
    q = rng.standard_normal((t_total, num_heads, head_dim)).astype(np.float32)
    kp = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim)).astype(np.float32)
    vp = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim)).astype(np.float32)
    return RaggedCase(q, kp, vp, kv_lens, pages, cu, np.array([live], np.int32), max(q_lens))
