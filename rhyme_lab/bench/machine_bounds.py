"""This machine's own bounds, measured in the same run as the engine they judge.

A tokens/s figure on one CPU says little on another: the 2-core Intel Xeon and AMD EPYC of our
sessions differ by 2x in the update alone. What a decode pass can reach is set by the machine: a
plain decode pass of a small batch reads every weight once, so it cannot beat ``weight bytes /
memory bandwidth``; and its matmuls run at most as fast as the best float32 matmul the backend
(XLA) or a peer's (torch) reaches on the same shapes. The benchmarks report the engine against
these, measured here, not against a figure from elsewhere:

* ``read_bandwidth``: GB/s of a jitted float32 reduction over an array far larger than the caches
  (the reads a decode pass does for its weights);
* ``matmul_rate``: GFLOP/s of ``[m, k] @ [k, n]`` in float32 under XLA (jitted) and under torch
  (when importable), ``2 m k n`` flops per call;
* ``weight_read_ms``: the decode-pass bound, ``param_bytes / bandwidth``.

Every figure is the median of ``repeats`` timed calls after one warm-up call.
"""

from __future__ import annotations

import os

import numpy as np

from rhyme_lab.measure.timing import median_seconds

GB = 1e9


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict:
    """Read bandwidth (GB/s) of a jitted float32 sum over ``nbytes`` (default 1 GiB: far past
    any cache), the pattern of a decode pass reading its weights.

    Returns ``{"bytes", "seconds", "gb_per_s"}``."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    s = median_seconds(lambda: total(x).block_until_ready(), repeats, warmup=1)
    return {"bytes": int(x.size * 4), "seconds": s, "gb_per_s": x.size * 4 / s / GB}


def matmul_rate(m: int, k: int, n: int, repeats: int = 5, engines: tuple[str, ...] = ("xla", "torch")) -> dict:
    """GFLOP/s of a float32 ``[m, k] @ [k, n]`` per engine (``2 m k n`` flops a call).

    ``xla``: jitted ``jnp.dot`` on the default backend; ``torch``: ``torch.matmul`` with as many
    threads as this process may use (skipped, with the reason, when torch is not importable).

    Returns ``{"shape": [m, k, n], "flops", engine: {"seconds", "gflop_per_s"} | {"error"}}``."""
    flops = 2 * m * k * n
    out: dict = {"shape": [m, k, n], "flops": flops}
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
    if "xla" in engines:
        import jax
        import jax.numpy as jnp

        xa, xb = jnp.asarray(a), jnp.asarray(b)
        dot = jax.jit(jnp.dot)
        s = median_seconds(lambda: dot(xa, xb).block_until_ready(), repeats, warmup=1)
        out["xla"] = {"seconds": s, "gflop_per_s": flops / s / GB}
    if "torch" in engines:
        try:
            import torch
        except ImportError as exc:  # a peer, never a dependency
            out["torch"] = {"error": f"torch not importable: {exc}"}
        else:
            torch.set_num_threads(len(os.sched_getaffinity(0)))
            ta, tb = torch.from_numpy(a), torch.from_numpy(b)
            s = median_seconds(lambda: torch.matmul(ta, tb), repeats, warmup=1)
            out["torch"] = {"seconds": s, "gflop_per_s": flops / s / GB}
    return out


def weight_read_ms(param_bytes: int, gb_per_s: float) -> float:
    """The plain decode pass's bound (ms): every weight read once at the measured bandwidth."""
    return param_bytes / (gb_per_s * GB) * 1e3


def machine_bounds(param_bytes: dict[str, int], shapes: list[tuple[int, int, int]], *,
                   bandwidth_bytes: int = 1 << 30, repeats: int = 5,
                   engines: tuple[str, ...] = ("xla", "torch")) -> dict:
    """All of the above in one report: bandwidth, the matmul rates of ``shapes``, and per model
    (``name -> parameter bytes`` as the rollout holds them) the weight-reading bound of a pass."""
    bw = read_bandwidth(bandwidth_bytes, repeats)
    return {"cores": len(os.sched_getaffinity(0)), "read_bandwidth": bw,
            "matmul": [matmul_rate(*s, repeats=repeats, engines=engines) for s in shapes],
            "weight_read_ms": {name: weight_read_ms(b, bw["gb_per_s"]) for name, b in param_bytes.items()}}
