"""Rollout workers: one engine per sub-mesh, driven concurrently, busy intervals recorded.

HistoPipe needs each worker to advance on its own: a worker whose batch is short finishes early
and can take migrated tails, and the planner gives workers batches of different sizes. One
jitted SPMD program over all workers would run them in lockstep (every decode step waits for
every shard, and a shard whose sequences finished still occupies its devices for the step), so
we drive one ``RolloutEngine`` per sub-mesh from its own Python thread (the host loop releases
the GIL while XLA runs). See docs/architecture.md, "HistoPipe".
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import jax
import numpy as np

from rhyme_jax.rollout.engine import RolloutEngine, RolloutResult, SamplingParams
from rhyme_jax.rollout.gather import merge_results
from rhyme_jax.sched.migration import Migrant, TailMigration
from rhyme_jax.sched.timeline import WorkerInterval

_POLL_S = 0.002  # idle worker's wait between looks at the migration queue


@dataclass
class WorkersResult:
    """One step's rollouts over this process's workers.

    Attributes:
      result: ``RolloutResult`` in row order of the step (every row of every local worker).
      rows: ``int64[R]`` the step rows ``result`` covers, ascending.
      intervals: busy intervals (seconds from the step's start) per worker: ``kind`` is
        ``"batch"`` (its planned rows) or ``"migrated"`` (a continued tail).
      migrated: rows that moved to another worker; ``deferred``: stopped rows kept for the next
        step (one_step_off), not in ``result``.
    """

    result: RolloutResult
    rows: np.ndarray
    intervals: list[WorkerInterval]
    migrated: list[int] = field(default_factory=list)
    deferred: list[Migrant] = field(default_factory=list)


def run_workers(engines: Sequence[RolloutEngine], states: Sequence[Any], worker_rows: Sequence[np.ndarray],
                prompts: Sequence[Sequence[int]], prompt_ids: Sequence[int], sampling: SamplingParams,
                keys: Sequence[jax.Array], *, drafter=None, migration: TailMigration | None = None,
                prefixes: dict[int, tuple[np.ndarray, np.ndarray]] | None = None) -> WorkersResult:
    """Roll out ``worker_rows[w]`` on ``engines[w]`` (state ``states[w]``, key ``keys[w]``) for
    every local worker at once; one thread per worker when there are several.

    Args:
      prompts, prompt_ids: per step row (indexed by the rows in ``worker_rows``).
      drafter: HistoSpec ``Drafter``; each worker drafts through its own ``Drafter.batch``.
      migration: tail migration state (``TailMigration``) or None.
      prefixes: responses begun in an earlier step (deferred rows): row -> (tokens, logprobs).

    Returns:
      ``WorkersResult``. A migrated row continues on the idle worker with that worker's key
      folded with the row, so under greedy sampling its tokens are those it would have had.
    """
    prefixes = prefixes or {}
    t0 = time.perf_counter()
    done: dict[int, tuple[np.ndarray, np.ndarray, str]] = {}
    parts: list[RolloutResult] = []
    intervals: list[WorkerInterval] = []
    deferred: list[Migrant] = []
    lock = threading.Lock()
    busy = [len(worker_rows)]
    errors: list[BaseException] = []

    def stopped(m: Migrant) -> None:
        """A tail stopped by the monitor: queued for an idle worker now, or kept for next step."""
        if migration.defer:
            with lock:
                deferred.append(m)
        else:
            migration.push(m)

    def generate(w, rows, kind, key, pre=None, monitor=None, source=-1):
        batch = drafter.batch([prompt_ids[r] for r in rows]) if drafter is not None else None
        start = time.perf_counter() - t0
        on_stop = (lambda i, tok, lp: stopped(Migrant(int(rows[i]), tok, lp, w))) if monitor is not None else None
        out = engines[w].generate(states[w], [prompts[r] for r in rows], sampling, key, drafter=batch,
                                  prefixes=pre, monitor=monitor, on_stop=on_stop)
        with lock:
            intervals.append(WorkerInterval(w, start, time.perf_counter() - t0, kind, source))
            parts.append(out)
        return out

    def work(w):
        counted = False  # this worker's batch is done (busy count decremented)
        try:
            rows = np.asarray(worker_rows[w], np.int64)
            if rows.size:
                pre = [prefixes.get(int(r), (np.zeros(0, np.int32), np.zeros(0, np.float32))) for r in rows]
                monitor = migration.monitor(w) if migration is not None else None
                out = generate(w, rows, "batch", keys[w], pre if prefixes else None, monitor)
                for i, r in enumerate(rows):
                    if out.finish_reasons[i] != "migrated":  # migrated ones went out via on_stop
                        with lock:
                            done[int(r)] = (out.tokens[i], out.logprobs[i], out.finish_reasons[i])
            with lock:
                busy[0] -= 1
                counted = True
            if migration is None or migration.defer:
                return
            migration.set_idle(w, True)
            while True:  # idle: continue migrated tails until every worker is done
                m = migration.take(w)
                if m is None:
                    with lock:
                        if busy[0] == 0 and not migration.queue:
                            break
                    time.sleep(_POLL_S)
                    continue
                out = generate(w, np.array([m.row]), "migrated", jax.random.fold_in(keys[w], m.row),
                               [(m.tokens, m.logprobs)], source=m.source)
                with lock:
                    done[m.row] = (out.tokens[0], out.logprobs[0], out.finish_reasons[0])
            migration.set_idle(w, False)
        except BaseException as exc:  # re-raised in the caller's thread
            with lock:
                errors.append(exc)
                if not counted:  # let idle workers stop waiting for this one
                    busy[0] -= 1

    if len(worker_rows) == 1:
        work(0)
    else:
        threads = [threading.Thread(target=work, args=(w,), name=f"rollout-worker-{w}")
                   for w in range(len(worker_rows))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    rows = np.array(sorted(done), np.int64)
    stats = merge_results(parts).stats if parts else {}
    result = RolloutResult(tokens=[done[r][0] for r in rows], logprobs=[done[r][1] for r in rows],
                           finish_reasons=[done[r][2] for r in rows], stats=stats)
    result.stats["workers"] = len(worker_rows)
    return WorkersResult(result, rows, sorted(intervals, key=lambda i: (i.worker, i.start)),
                         migrated=sorted(migration.moved) if migration is not None else [],
                         deferred=deferred)
