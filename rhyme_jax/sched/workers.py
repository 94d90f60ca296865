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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import numpy as np

from rhyme_jax.rollout.gather import merge_results
from rhyme_jax.rollout.types import RolloutResult, SamplingParams
from rhyme_jax.sched.carry import CarriedRow
from rhyme_jax.sched.migration import TailMigration
from rhyme_jax.sched.timeline import WorkerInterval

_POLL_S = 0.002  # idle worker's wait between looks at the migration queue

# A worker's ``RolloutEngine.generate`` (or a wrapper around it with the same signature:
# ``(state, prompts, sampling, key, *, drafter, prefixes, monitor, on_stop) -> RolloutResult``).
GenerateFn = Callable[..., RolloutResult]


@dataclass
class StepRollout:
    """One step's rollouts: the one type from the workers to the trainer's groups.

    ``StepWork.result()`` fills the process-local fields; ``RolloutScheduler.collect`` returns it
    gathered across processes (rows in step order) with the scheduler's fields set.

    Attributes:
      result: ``RolloutResult`` of the rows ``rows`` (ascending): every row of the step except
        ``deferred`` ones, then the continued carried rows (numbered from ``P * n`` on).
      rows: ``int64[R]`` the step rows ``result`` covers, ascending.
      intervals: busy intervals (seconds from the step's start) per worker: ``kind`` is
        ``"batch"`` (its planned rows), ``"migrated"`` (a continued tail), or, for a queued
        step, ``"next step"`` / ``"train"``.
      deferred: rows stopped for a later step (one_step_off + migration; ``row`` = the step row).
      migrated: rows that moved to another worker.
      metrics: ``sched/*`` floats (bubble fraction, earliest-finisher idle, makespan, migrated and
        deferred shares, predicted makespan, tier-1 direction); empty before ``collect``.
      plan: the planner's output (``sched.planner.Plan``: rows per worker, ranking groups); None
        before ``collect``.
      group_finish_s: ``f64[G]`` completion time of each ranking group (its workers' last end);
        empty before ``collect``.
    """

    result: RolloutResult
    rows: np.ndarray
    intervals: list[WorkerInterval]
    deferred: list[CarriedRow] = field(default_factory=list)
    migrated: list[int] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    plan: Any = None
    group_finish_s: np.ndarray = field(default_factory=lambda: np.zeros(0))


class StepWork:
    """One step's rollout over this process's workers, as one job per worker.

    ``work(w)`` runs worker ``w``'s rows (then, in sync migration, continues migrated tails until
    every worker is done); ``run_now`` runs the jobs on one thread each and joins, and
    ``WorkerQueues`` runs them on per-worker queues so a worker goes on to the next step's job as
    soon as its own part is done (cross-step). ``result()`` assembles the ``StepRollout`` once
    every job has finished. A migrated row continues on the idle worker with that worker's key
    folded with the row, so under greedy sampling its tokens are those it would have had.

    Args:
      generate: per local worker, its engine's ``generate`` (``GenerateFn``).
      states: the params in each worker's layout; ``keys``: each worker's key.
      worker_rows: ``int64[r_w]`` step rows of each worker, in the order its engine gets them.
      prompts, prompt_ids: prompt tokens and prompt id of every step row (indexed by row).
      drafter: HistoSpec ``Drafter`` (each worker drafts through its own ``Drafter.batch``) or None.
      migration: tail migration state (``TailMigration``) or None.
      carried: rows a response was begun for in an earlier step, by row (``CarriedRow``).
      origin: ``time.perf_counter()`` value the intervals are measured from (default: now).
      draft_batches: per worker, the HistoSpec ``DraftBatch`` of its rows, made when the step was
        submitted (cross-step queues: drafts then come from the history as it was at submission,
        whatever write-backs happen before the job starts); None = made when the job starts.
    """

    def __init__(self, generate: Sequence[GenerateFn], states: Sequence[Any], worker_rows: Sequence[np.ndarray],
                 prompts: Sequence[Sequence[int]], prompt_ids: Sequence[int], sampling: SamplingParams,
                 keys: Sequence[jax.Array], *, drafter=None, migration: TailMigration | None = None,
                 carried: dict[int, CarriedRow] | None = None, origin: float | None = None,
                 draft_batches: Sequence[Any] | None = None):
        self.generate, self.states, self.worker_rows = list(generate), states, worker_rows
        self.prompts, self.prompt_ids, self.sampling, self.keys = prompts, prompt_ids, sampling, keys
        self.drafter, self.migration, self.carried = drafter, migration, carried or {}
        self.draft_batches = draft_batches
        self.t0 = time.perf_counter() if origin is None else float(origin)
        self.started: list[float | None] = [None] * len(worker_rows)  # job start per worker (from t0)
        self.done: dict[int, tuple[np.ndarray, np.ndarray, str]] = {}
        self.parts: list[RolloutResult] = []
        self.intervals: list[WorkerInterval] = []
        self.deferred: list[CarriedRow] = []
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._busy = len(worker_rows)

    def _stopped(self, w: int, row: int, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        """A tail stopped by worker ``w``'s monitor: queued for an idle worker now, or kept for a
        later step."""
        m = CarriedRow(row, int(self.prompt_ids[row]), np.asarray(self.prompts[row], np.int32), tokens, logprobs, w)
        if self.migration.defer:
            with self._lock:
                self.deferred.append(m)
        else:
            self.migration.push(m)

    def _generate(self, w, rows, kind, key, pre=None, monitor=None, source=-1):
        if kind == "batch" and self.draft_batches is not None:
            batch = self.draft_batches[w]
        else:
            batch = self.drafter.batch([self.prompt_ids[r] for r in rows]) if self.drafter is not None else None
        start = time.perf_counter() - self.t0
        on_stop = ((lambda i, tok, lp: self._stopped(w, int(rows[i]), tok, lp)) if monitor is not None else None)
        out = self.generate[w](self.states[w], [self.prompts[r] for r in rows], self.sampling, key,
                               drafter=batch, prefixes=pre, monitor=monitor, on_stop=on_stop)
        with self._lock:
            self.intervals.append(WorkerInterval(w, start, time.perf_counter() - self.t0, kind, source))
            self.parts.append(out)
        return out

    def work(self, w: int) -> None:
        """Worker ``w``'s job; an exception is kept for ``result()`` (and lets idle workers stop
        waiting for this one)."""
        self.started[w] = time.perf_counter() - self.t0
        migration = self.migration
        counted = False  # this worker's batch is done (busy count decremented)
        try:
            rows = np.asarray(self.worker_rows[w], np.int64)
            if rows.size:
                none = (np.zeros(0, np.int32), np.zeros(0, np.float32))
                pre = [self.carried[int(r)].prefix if int(r) in self.carried else none for r in rows]
                monitor = migration.monitor(w) if migration is not None else None
                out = self._generate(w, rows, "batch", self.keys[w], pre if self.carried else None, monitor)
                for i, r in enumerate(rows):
                    if out.finish_reasons[i] != "migrated":  # migrated ones went out via on_stop
                        with self._lock:
                            self.done[int(r)] = (out.tokens[i], out.logprobs[i], out.finish_reasons[i])
            with self._lock:
                self._busy -= 1
                counted = True
            if migration is None or migration.defer:
                return
            migration.set_idle(w, True)
            while True:  # idle: continue migrated tails until every worker is done
                m = migration.take(w)
                if m is None:
                    with self._lock:
                        if self._busy == 0 and not migration.queue:
                            break
                    time.sleep(_POLL_S)
                    continue
                out = self._generate(w, np.array([m.row]), "migrated", jax.random.fold_in(self.keys[w], m.row),
                                     [m.prefix], source=m.source)
                with self._lock:
                    self.done[m.row] = (out.tokens[0], out.logprobs[0], out.finish_reasons[0])
            migration.set_idle(w, False)
        except BaseException as exc:  # re-raised by result() in the caller's thread
            with self._lock:
                self.errors.append(exc)
                if not counted:
                    self._busy -= 1

    def result(self) -> StepRollout:
        """This process's part of the step as a ``StepRollout`` (call after every ``work(w)`` returned).

        Raises:
          The first exception a worker raised.
        """
        if self.errors:
            raise self.errors[0]
        rows = np.array(sorted(self.done), np.int64)
        stats = merge_results(self.parts).stats if self.parts else {}
        done = self.done
        result = RolloutResult(tokens=[done[r][0] for r in rows], logprobs=[done[r][1] for r in rows],
                               finish_reasons=[done[r][2] for r in rows], stats=stats)
        result.stats["workers"] = len(self.worker_rows)
        m = self.migration
        return StepRollout(result, rows, sorted(self.intervals, key=lambda i: (i.worker, i.start)),
                           deferred=self.deferred, migrated=sorted(m.moved) if m is not None else [])


def run_now(job: StepWork) -> None:
    """Run a step's worker jobs to the end: one thread per worker when there are several."""
    W = len(job.worker_rows)
    if W == 1:
        job.work(0)
        return
    threads = [threading.Thread(target=job.work, args=(w,), name=f"rollout-worker-{w}") for w in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class WorkerQueues:
    """Cross-step worker queues: one single-thread executor per local rollout worker, so each
    worker runs its jobs in submission order and starts its part of step s + 1 as soon as its
    part of step s is done, without waiting for the other workers (``sched.cross_step``; the
    tier-1 odd/even order then pays off across steps: docs/architecture.md, "HistoPipe").

    Args:
      num_workers: local workers W.
    """

    def __init__(self, num_workers: int):
        self.pools = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rollout-worker-{w}")
                      for w in range(int(num_workers))]

    def submit(self, job: StepWork) -> list[Future]:
        """Queue ``job.work(w)`` on worker ``w``'s executor for every worker; returns the futures."""
        if len(job.worker_rows) != len(self.pools):
            raise ValueError(f"WorkerQueues: job has {len(job.worker_rows)} workers, queues {len(self.pools)}")
        return [pool.submit(job.work, w) for w, pool in enumerate(self.pools)]

    def close(self) -> None:
        """Let queued jobs finish, then stop the threads."""
        for pool in self.pools:
            pool.shutdown(wait=True)
