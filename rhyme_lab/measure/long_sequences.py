"""How the engine's per-sequence state grows with sequence length (long, long-tailed rollouts).

RhymeRL's regime has responses of 2K-11K+ tokens. Each piece that holds a sequence must stay
bounded per token as the length grows, else the long tail costs more than its tokens:

* the KV pages a sequence holds (``ceil(L / page_size)`` pages: linear in ``L``, nothing more);
* a decode pass at context ``L`` (``PassRunner.run`` for ``rows`` sequences of ``L`` cached
  tokens: attention reads ``L`` keys, so a pass grows with ``L``; the weights' part does not);
* the drafter's history: the store's bytes (``HistoryStore.to_bytes``) and the suffix index's
  build time and bytes (``spec.drafter.index_of``) for a prompt with ``rows`` responses of ``L``
  tokens;
* the rollout log (``io.rollout_log.save_rollouts``) bytes.

``long_sequence_growth`` measures each at every length and divides by the tokens, so a table of
per-token figures that stays flat shows the bound (``python -m benchmarks.long_sequences``).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from rhyme_jax.io.rollout_log import save_rollouts
from rhyme_jax.spec.drafter import index_of
from rhyme_jax.spec.history import HistoryStore


def history_growth(length: int, rows: int, vocab: int, rng: np.random.Generator) -> dict:
    """History store bytes and suffix-index build seconds / bytes for one prompt with ``rows``
    responses of ``length`` tokens (random tokens of a ``vocab``-token vocabulary: fewer repeats
    than text, so more automaton states: the worst case)."""
    store = HistoryStore(depth=1)
    prompt = rng.integers(0, vocab, 32).astype(np.int32)
    responses = [rng.integers(0, vocab, length).astype(np.int32) for _ in range(rows)]
    store.update(1, np.zeros(rows, np.int64), [prompt] * rows, responses, np.zeros(rows, np.float32))
    t0 = time.perf_counter()
    index = index_of(store.entry(0))
    build_s = time.perf_counter() - t0
    return {"store_bytes": len(store.to_bytes()), "index_bytes": int(index.nbytes),
            "index_build_s": build_s, "index_states": int(index.num_states)}


def log_growth(length: int, rows: int, vocab: int, rng: np.random.Generator) -> int:
    """Bytes of one step's rollout log with ``rows`` responses of ``length`` tokens and their
    behaviour logprobs."""
    with tempfile.TemporaryDirectory() as d:
        responses = [rng.integers(0, vocab, length) for _ in range(rows)]
        path = save_rollouts(d, 1, np.zeros(rows, np.int64), responses, np.zeros(rows, np.float32),
                             [rng.random(length).astype(np.float32) for _ in range(rows)])
        return Path(path).stat().st_size


def long_sequence_growth(lengths: list[int], rows: int, *, model: str = "demo", iters: int = 5,
                         log=print) -> list[dict]:
    """Per length ``L``: KV bytes held, decode-pass ms at context ``L``, history store and index
    bytes and build time, rollout-log bytes, each also per token (divided by ``rows x L``).

    The pass is timed on random weights of ``model`` (``measure.pass_cost.model_config``) with
    ``rows`` sequences of ``L`` cached tokens (one engine per length: its pool holds ``L``)."""
    from rhyme_lab.measure.pass_cost import model_config, pass_costs, pass_engine

    cfg = model_config(model)
    rng = np.random.default_rng(0)
    history_growth(16, 2, cfg.vocab_size, rng)  # numba's kernels load (or compile) once, untimed
    out = []
    for L in lengths:
        eng, state = pass_engine(cfg, "float32", rows, L, 0)
        kv_bytes = int(rows * -(-L // eng.page_size) * eng.page_size * cfg.num_layers * 2
                       * cfg.num_kv_heads * cfg.head_dim * 4)
        ms = pass_costs(eng, state, [0], rows, L, iters, log=None)[0]["ms"]
        row = {"length": L, "rows": rows, "kv_bytes": kv_bytes, "pass_ms": ms,
               **history_growth(L, rows, cfg.vocab_size, rng), "log_bytes": log_growth(L, rows, cfg.vocab_size, rng)}
        tokens = rows * L
        row.update({f"{k}_per_token": row[k] / tokens for k in ("kv_bytes", "store_bytes", "index_bytes",
                                                                "log_bytes")},
                   index_build_us_per_token=row["index_build_s"] / tokens * 1e6,
                   pass_us_per_context_token=ms * 1e3 / L)
        out.append(row)
        if log:
            log(f"L={L:6d}: KV {row['kv_bytes_per_token']:.0f} B/token, pass {ms:.2f} ms, history "
                f"{row['store_bytes_per_token']:.1f} + index {row['index_bytes_per_token']:.1f} B/token "
                f"(build {row['index_build_us_per_token']:.2f} us/token), log {row['log_bytes_per_token']:.1f} B/token")
    return out
