"""The held-out evaluation before GRPO, computed once per warm start and shared by the units that
start from it.

A unit with ``held_out`` evaluates its policy greedily on the held-out problems before and after
its GRPO steps (``e2e._grpo_unit``). Before any step the policy is the warm start's, so units of
different run seeds that start from one warm start (L5's two learning seeds) would decode the same
responses: greedy decoding does not draw from the run's key. On the ledger task one evaluation of
400 problems took 14 minutes on 2 cores (L5's warm start), so the first unit stores its result beside the warm
start's params (``<warm start>/held_out_before/<key>.json``) and the next reads it back.

The key hashes everything the greedy responses and their scores depend on: the ``model``,
``data``, ``rollout`` and ``reward`` sections (paths resolved), ``run.init_from`` with its files'
sizes and modification times, ``run.eval_samples`` and, when the evaluation samples (mean@k draws with
``run.seed``), the run seed. A changed warm start or eval set misses the cache; a change of the
code that decodes or scores (the engine, the reward) does not: delete ``held_out_before/`` then.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from rhyme_jax.io.atomic import atomic_write

CACHE_DIR = "held_out_before"


def cache_key(cfg) -> str:
    """Hex digest (16 chars) of what the before-GRPO evaluation of ``cfg`` depends on (module
    docstring); ``""`` when the run has no warm start (``run.init_from`` empty): nothing to share."""
    if not cfg.run.init_from:
        return ""
    params = Path(cfg.run.init_from)
    files = sorted((str(p.relative_to(params)), p.stat().st_size, p.stat().st_mtime_ns)
                   for p in params.rglob("*") if p.is_file())
    model = cfg.model
    if model.tokenizer_path:  # the same tokenizer named from another directory: the same key
        model = dataclasses.replace(model, tokenizer_path=str(Path(model.tokenizer_path).resolve()))
    parts = {"model": repr(model), "data": repr(cfg.data), "rollout": repr(cfg.rollout),
             "reward": repr(cfg.reward), "init_from": str(params.resolve()), "files": files,
             "eval_samples": int(cfg.run.eval_samples),
             "seed": int(cfg.run.seed) if cfg.run.eval_samples else None}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(cfg) -> Path | None:
    """``<run.init_from>/../held_out_before/<key>.json``, or None without a warm start."""
    key = cache_key(cfg)
    return Path(cfg.run.init_from).parent / CACHE_DIR / f"{key}.json" if key else None


def before_eval(trainer, cfg):
    """``trainer.evaluate()`` of the policy before GRPO, read from the warm start's cache when a unit
    with the same key stored it, else computed and stored (atomically).

    Args:
      trainer: a ``GRPOTrainer`` that has not stepped yet (its policy is the warm start).
      cfg: its ``RunConfig``.

    Returns:
      ``rhyme_jax.train.evaluate.EvalResult``.
    """
    from rhyme_jax.train.evaluate import EvalResult

    path = cache_path(cfg)
    if path is not None and path.is_file():
        doc = json.loads(path.read_text())
        arrays = {k: None if doc[k] is None else np.asarray(doc[k], np.float64)
                  for k in ("correct", "sampled_per_problem")}
        return EvalResult(**{**doc, **arrays})
    res = trainer.evaluate()
    if path is not None:
        doc = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in dataclasses.asdict(res).items()}
        with atomic_write(path, "w") as fh:
            json.dump(doc, fh)
    return res
