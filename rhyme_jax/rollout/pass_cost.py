"""Pass-cost model of the rollout engine: seconds of one decode/verify program, per shape.

HistoSpec's goodput allocation (``rollout/allocation.py``) weighs the tokens a draft is expected
to add against what the bigger step costs. That trade depends on the backend (on CPU a verify
step with 2 drafts per row costs ~1.8x a decode step at 128 rows; on an H200 3 drafts cost
~1.2x), on the live rows and on the packed tokens, so the model is measured, not assumed:

* ``profile`` times every decode/verify program of an engine (``ShapePlan.programs``) on dummy
  inputs after compiling it (fastest of ``repeats`` runs; a few seconds on CPU for the demo);
* ``PassCost`` holds ``seconds[(rows, tokens, max_q_len)]`` (at the widest page table) and is
  saved as JSON; ``cache_path`` keys the file by model, dtype, backend, device kind and the
  engine's plan, so a run profiles once per machine kind and later runs load the file;
* ``PassCost.prior`` (no profile: tests, replays without a file) is the analytical stand-in
  ``2 * rows + tokens`` (a step costs its packed tokens plus a per-row overhead of two tokens).

The allocation only compares the programs of one row bucket, so the unit does not matter.
Source: the issue "goodput-optimal HistoSpec" scope 3; the cost-aware draft length of
SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975) and TurboSpec's goodput (Liu et al. 2024).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from rhyme_jax.io.atomic import atomic_write
from rhyme_jax.model.hub import cache_dir

FORMAT_VERSION = 1
PROFILE_VERSION = 9  # what programs are and how they are timed (part of the cache key): 3 = rows live on their own
# pages, median of rounds; 4 = the same after the per-position sampling draws (cheaper decode sampling);
# 5 = KV writes in place in the 1-token decode program (it copied the pool before); 6 = verify steps'
# attention laid out per packed token on the reference path (cheaper verify programs on CPU); 7 = the
# reference picks its layout per shape (per token up to 2 tokens per sequence: decode too); 8 = verify
# programs' max_q_len 2 T / S + 1 (was 4 T / S + 1); 9 = two-level Gumbel-max draws (was an inverse CDF)
PRIOR_ROW_TOKENS = 2.0  # per-row overhead of the prior, in packed tokens
CACHE_ENV = "RHYME_JAX_STEP_COST_DIR"
LIVE_WINDOW = 15  # live step times kept per program; their median replaces the profiled figure
LIVE_MIN = 3  # ... once a program has run this many times in rollouts


class PassCostError(ValueError):
    """A missing, unreadable or inconsistent pass-cost file (the message names path and field)."""


@dataclass(frozen=True)
class PassCost:
    """Seconds of the decode/verify pass programs of one engine.

    Attributes:
      seconds: ``{(rows, tokens, max_q_len): seconds}`` measured per program (empty = prior).
      meta: what the profile was measured on (backend, device, model; informational).
      live: ``{(rows, tokens, max_q_len, width): (recent seconds, median or None)}`` from
        ``observe`` (rollout passes at page-table width ``width``, 0 = not given; not saved, not
        compared).
      scale: ``{(rows, width): factor}``, the median of live median / profiled time over the
        programs of a row bucket with a live median at that width (``observe``); the bucket's
        other programs cost their profiled time times it at that width.
    """

    seconds: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    live: dict = field(default_factory=dict, compare=False, repr=False)  # key -> (recent times, median)
    scale: dict = field(default_factory=dict, compare=False, repr=False)  # (rows, width) -> live / profiled
    _medians: dict = field(default_factory=dict, compare=False, repr=False)  # (rows, width) -> {key: live median}

    @classmethod
    def prior(cls) -> "PassCost":
        """The analytical stand-in (no measurements): ``2 * rows + tokens``."""
        return cls({}, {"source": "prior"})

    def __call__(self, rows: int, tokens: int, q_len: int, width: int = 0) -> float:
        """Seconds (or prior units) of the ``(rows, tokens, q_len)`` program at page-table width
        ``width`` (0: not given): its live median there once ``observe`` has ``LIVE_MIN`` times
        of it, else its profiled time times the live scale of its row bucket at that width
        (``scale``: 1 until a program of the bucket has a live median there). A pass's cost
        depends on the width (its attention covers the whole page table: on the ledger task's
        pool a 64-row decode pass ran 11 / 34 / 111 ms at 24 / 96 / 384 pages),
        so programs are compared at one width, never a verify program timed on short rows
        against a decode program timed on long ones. A shape that was not profiled is scaled
        from the profiled program of the same rows with the nearest token count (cost
        proportional to ``2 * rows + tokens``); a row bucket that was not profiled at all
        (another engine's plan, e.g. a replay with other ``--rows``) uses the least-squares fit
        ``a + b * rows + c * tokens`` (``a, b, c >= 0``) of the profile; no profile: the prior."""
        key = (int(rows), int(tokens), int(q_len))
        live = self.live.get((*key, int(width)))
        if live is not None and live[1] is not None:
            return live[1]
        hit = self.seconds.get(key)
        factor = self.scale.get((key[0], int(width)), 1.0)
        if hit is not None:
            return hit * factor
        prior = PRIOR_ROW_TOKENS * rows + tokens
        same = [(abs(t - tokens), t, s) for (r, t, _), s in self.seconds.items() if r == rows]
        if same:
            _, t, s = min(same)
            return s * factor * prior / (PRIOR_ROW_TOKENS * rows + t)
        if not self.seconds:
            return prior
        a, b, c = self._linear()
        return (a + b * rows + c * tokens) * factor

    def observe(self, rows: int, tokens: int, q_len: int, seconds: float, width: int = 0) -> None:
        """Record one live step time (seconds, the engine's pass on the host clock) of the
        ``(rows, tokens, q_len)`` program at page-table width ``width`` in a rollout. Once a
        program has ``LIVE_MIN`` live times at a width, ``__call__`` returns the median of its
        last ``LIVE_WINDOW`` there instead of the profiled figure: the profile times programs in
        rounds on dummy rows at the widest table, and a rollout runs them in its own order at its
        own widths (on CPU, 32 rows of the demo: plain decode steps back to back ran at 0.80x
        their profiled time while verify steps matched theirs, so verify looked cheaper than it
        was and HistoSpec ran at 0.88x plain). The programs of the bucket that have no live
        median yet at that width are scaled by the bucket's median live / profiled ratio there
        (``scale``): a profile taken under other conditions (a cached file, a busy machine) can
        put every program at twice its rollout time, and a decode program corrected alone would
        make every verify program look twice as dear as it is, so that drafting never ran and
        its verify programs never got live times (the demo's learning run drafted almost nothing
        for 7 steps of its second epoch: decode 8.7 ms live against 17.9 ms profiled, verify
        49.1 ms profiled and 23.9 ms once it ran). Ignored without a profile (the prior's units
        are not seconds). Not saved: a profile file holds what ``profile`` measured."""
        if not self.seconds:
            return
        key = (int(rows), int(tokens), int(q_len), int(width))
        times, _ = self.live.get(key, ((), None))
        times = (*times[1 - LIVE_WINDOW:], float(seconds))
        median = sorted(times)[len(times) // 2] if len(times) >= LIVE_MIN else None
        self.live[key] = (times, median)
        if median is None:
            return  # no live median in the bucket changed
        medians = self._medians.setdefault((key[0], key[3]), {})  # the bucket's programs with a live median there
        medians[key[:3]] = median
        scale = bucket_scales(self.seconds, medians).get(key[0])
        if scale is not None:
            self.scale[(key[0], key[3])] = scale

    def _linear(self) -> tuple[float, float, float]:
        """Non-negative least-squares ``(a, b, c)`` of ``seconds ~ a + b * rows + c * tokens``."""
        keys = sorted(self.seconds)
        x = np.array([[1.0, r, t] for r, t, _ in keys])
        y = np.array([self.seconds[k] for k in keys])
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
        if np.any(coef < 0):  # drop the negative terms and refit the rest
            keep = coef >= 0
            coef = np.zeros(3)
            if keep.any():
                coef[keep] = np.clip(np.linalg.lstsq(x[:, keep], y, rcond=None)[0], 0, None)
        if not np.any(coef > 0):
            coef = np.array([float(y.mean()), 0.0, 0.0])
        return float(coef[0]), float(coef[1]), float(coef[2])

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON atomically; returns the path."""
        path = Path(path)
        body = {"format_version": FORMAT_VERSION, "meta": self.meta,
                "programs": [{"rows": r, "tokens": t, "q_len": q, "seconds": s}
                             for (r, t, q), s in sorted(self.seconds.items())]}
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path, "w") as fh:
            json.dump(body, fh, indent=1)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "PassCost":
        """Read a profile written by ``save``.

        Raises:
          PassCostError: missing or unreadable file, wrong format version, or a program entry
            without positive integer ``rows/tokens/q_len`` and positive finite ``seconds``.
        """
        path = Path(path)
        try:
            body = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise PassCostError(f"{path}: unreadable pass-cost profile ({exc})") from None
        if not isinstance(body, dict) or body.get("format_version") != FORMAT_VERSION:
            raise PassCostError(f"{path}: field format_version: expected {FORMAT_VERSION}")
        out = {}
        for i, p in enumerate(body.get("programs", [])):
            try:
                key = (int(p["rows"]), int(p["tokens"]), int(p["q_len"]))
                sec = float(p["seconds"])
            except (KeyError, TypeError, ValueError):
                raise PassCostError(f"{path}: field programs[{i}]: needs rows, tokens, q_len, seconds") from None
            if min(key) < 1 or not 0 < sec < float("inf"):
                raise PassCostError(f"{path}: field programs[{i}]: sizes must be >= 1 and seconds > 0")
            out[key] = sec
        if not out:
            raise PassCostError(f"{path}: field programs: empty")
        return cls(out, dict(body.get("meta", {})))


def bucket_scales(seconds: dict, medians: dict) -> dict[int, float]:
    """``{rows: factor}``: per row bucket, the median of live median / profiled seconds over its
    programs that have both (``seconds``, ``medians``: ``{(rows, tokens, max_q_len): seconds}``);
    buckets without such a program are left out (``PassCost.observe``)."""
    ratios: dict[int, list[float]] = {}
    for k, m in medians.items():
        if k in seconds:
            ratios.setdefault(k[0], []).append(m / seconds[k])
    return {r: float(statistics.median(v)) for r, v in ratios.items()}  # not np.median: runs every pass


def cache_key(parts: dict) -> str:
    """A short stable hash of what a profile depends on (model shape, dtype, backend, plan)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_path(parts: dict) -> Path:
    """Where the profile of ``parts`` is cached: ``$RHYME_JAX_STEP_COST_DIR`` or
    ``<rhyme-jax cache>/step_cost`` (``rhyme_jax.model.hub.cache_dir()``: ``$RHYME_JAX_CACHE``,
    else ``~/.cache/rhyme_jax``), file ``<cache_key>.json``."""
    root = Path(os.environ.get(CACHE_ENV) or cache_dir() / "step_cost")
    return root / f"{cache_key(parts)}.json"


def profile(run_program: Callable[[object], None], shapes: Iterable, repeats: int = 5) -> dict:
    """``{(rows, tokens, q_len): seconds}`` of ``run_program(shape)`` per step shape: the median of
    ``repeats`` timed runs, taken in rounds over all shapes (one run of each shape per round, as a
    rollout alternates its programs; back-to-back runs of one program time faster than it runs in
    a rollout, and the largest programs vary the most).

    ``run_program`` must block until the step's outputs are on the host (the engine's ``_run``
    does). Each shape first runs twice untimed (compile or cache load, then the first run on the
    donated KV pool it returned). Only the widest page table of each ``(rows, tokens, q_len)`` is
    timed; the result is made non-decreasing in tokens per row bucket (``monotone``).
    """
    widest = {}
    for s in shapes:
        if s.kind not in ("decode", "verify"):  # prefill and chunk programs are not step costs
            continue
        key = (s.rows, s.tokens, s.q_len)
        if key not in widest or s.width > widest[key].width:
            widest[key] = s
    todo = sorted(widest.items())
    for _, s in todo:
        run_program(s)  # compiles (or loads) the program
        run_program(s)  # a donated buffer's first reuse may specialise once more
    times: dict = {key: [] for key, _ in todo}
    for _ in range(max(1, int(repeats))):
        for key, s in todo:
            t0 = time.perf_counter()
            run_program(s)
            times[key].append(time.perf_counter() - t0)
    return monotone({key: float(np.median(v)) for key, v in times.items()})


def monotone(seconds: dict) -> dict:
    """``seconds`` with each row bucket's costs made non-decreasing in packed tokens (a running
    maximum): a program packing more tokens never costs less, so a lower figure is timing noise."""
    out, top = {}, {}
    for (r, t, q), s in sorted(seconds.items()):
        top[r] = max(top.get(r, 0.0), s)
        out[(r, t, q)] = top[r]
    return out


__all__ = ["PassCost", "PassCostError", "bucket_scales", "cache_key", "cache_path", "monotone", "profile"]
