"""One step's rollout over the rollout workers: plan (fifo or HistoPipe), run, gather, measure.

``RolloutScheduler.rollout`` is what ``GRPOTrainer`` calls each step (docs/architecture.md, "HistoPipe"):

1. predict each prompt's length from the history store (``length_predictor``);
2. plan rows onto the global workers (``planner.plan_step``: fifo, or tier 1 ranking groups with
   odd/even order and tier 2 worker counts);
3. run this process's workers concurrently (``workers.StepWork``: a thread per worker, or the
   cross-step ``WorkerQueues``) with tail migration when on;
4. all-gather across processes and put the rows back in step order;
5. bubble metrics from the workers' busy intervals (``timeline.bubble_metrics``).

Scheduling changes where and when rows run, never the sampling law; under greedy sampling the
responses are identical with and without HistoPipe (tests/test_sched_workers.py).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import jax
import numpy as np

from rhyme_jax.rollout.engine import RolloutEngine
from rhyme_jax.rollout.gather import COUNT_STATS, allgather_results
from rhyme_jax.rollout.types import RolloutResult, SamplingParams
from rhyme_jax.sched.carry import CarriedRow
from rhyme_jax.sched.cost_model import DEFAULT_COST_MODEL, CostModel
from rhyme_jax.sched.length_predictor import predict_lengths
from rhyme_jax.sched.migration import TailMigration
from rhyme_jax.sched.planner import Plan, plan_step
from rhyme_jax.sched.timeline import NEXT_STEP, TRAIN, WorkerInterval, bubble_metrics
from rhyme_jax.sched.workers import GenerateFn, StepRollout, StepWork, WorkerQueues, run_now

if TYPE_CHECKING:
    from rhyme_jax.config import SchedSection

MODES = ("fifo", "histopipe")
PIPELINES = ("sync", "one_step_off")


class RolloutScheduler:
    """Rollout workers of this process plus the HistoPipe switches (``sched`` config section).

    Args:
      engines: one ``RolloutEngine`` per local worker (each on its sub-mesh).
      cfg: the ``sched`` section: ``mode``, ``pipeline``, ``tier1``, ``tier2``, ``migration``,
        ``num_groups``, ``length_stat``, ``growth``, ``tail_fraction``, ``cost_model`` (path).
      max_new_tokens: the cold-start length prediction is half of it.
      wrap_generate: a hook around every engine call: ``wrap_generate(engine.generate)`` is what
        the workers call instead (same signature; e.g. a benchmark timing a second, plain rollout
        of the same inputs); None = the engines' own ``generate``.

    Raises:
      CostModelError: ``sched.cost_model`` names a missing or invalid file.
    """

    def __init__(self, engines: Sequence[RolloutEngine], cfg: SchedSection, max_new_tokens: int, *,
                 wrap_generate: Callable[[GenerateFn], GenerateFn] | None = None):
        self.engines = list(engines)
        self.generate = [e.generate if wrap_generate is None else wrap_generate(e.generate) for e in self.engines]
        self.cfg = cfg
        self.max_new_tokens = int(max_new_tokens)
        self.cost_model = CostModel.load(cfg.cost_model) if cfg.cost_model else DEFAULT_COST_MODEL
        self.local = len(self.engines)
        self.total = self.local * jax.process_count()
        self.first = jax.process_index() * self.local
        self.queues: WorkerQueues | None = None  # cross-step worker queues, made on first use
        self._queued: list[PendingRollout] = []  # queued steps not yet collected, in order
        self._origin = time.perf_counter()  # clock of queued steps' intervals
        self._last_end = -np.inf  # end of the last collected queued step (scheduler clock)
        self._train: list[tuple[float, float]] = []  # updates on the shared devices (scheduler clock)

    def plan(self, step: int, prompt_ids: Sequence[int], n: int, history) -> tuple[Plan, np.ndarray]:
        """The step's plan over all global workers and the ``f64[P]`` length predictions."""
        c = self.cfg
        if history is not None and c.mode == "histopipe":
            pred = predict_lengths(history, np.asarray(prompt_ids), c.length_stat,
                                   default=self.max_new_tokens / 2)
        else:
            pred = np.full(len(prompt_ids), self.max_new_tokens / 2)
        plan = plan_step(step, pred, n, self.total, self.cost_model, mode=c.mode, tier1=c.tier1,
                         tier2=c.tier2, num_groups=c.num_groups, exact=c.placement == "exact",
                         spread=c.placement == "spread")
        return plan, pred

    def rollout(self, step: int, states: Sequence[Any], prompt_ids: Sequence[int], prompts: Sequence[Sequence[int]],
                n: int, sampling: SamplingParams, key: jax.Array, *, history=None, drafter=None,
                carried: Sequence[CarriedRow] = (), defer: bool = False) -> StepRollout:
        """Roll out ``prompts`` (``n`` rows per prompt id of ``prompt_ids``, in order) now.

        Args:
          states: the params in each local worker's layout (the weight sync's output).
          key: the step's key; worker ``w`` of ``W > 1`` uses ``fold_in(key, w)``.
          carried: rows carried from an earlier step (one_step_off deferral;
            ``carry.pending_rows(groups, P * n)``): the e-th must be row ``P * n + e``; they go
            to the workers with the least predicted work and are never deferred again.
          defer: stop tails for the next step instead of migrating them (one_step_off).

        Returns:
          ``StepRollout``.
        """
        return self.collect(self.submit(step, states, prompt_ids, prompts, n, sampling, key, history=history,
                                        drafter=drafter, carried=carried, defer=defer))

    def submit(self, step: int, states: Sequence[Any], prompt_ids: Sequence[int], prompts: Sequence[Sequence[int]],
               n: int, sampling: SamplingParams, key: jax.Array, *, history=None, drafter=None,
               carried: Sequence[CarriedRow] = (), defer: bool = False, queued: bool = False) -> "PendingRollout":
        """Plan a step (arguments as ``rollout``) and start it.

        ``queued=False`` runs it to the end before returning (one thread per worker).
        ``queued=True`` (``sched.cross_step``) puts each worker's part on that worker's queue
        (``WorkerQueues``) behind its part of the steps submitted before, and returns at once;
        ``collect`` waits for it. Queued steps must be collected in submission order.

        Raises:
          ValueError: a carried row not numbered ``P * n + e``.
        """
        c = self.cfg
        plan, pred = self.plan(step, prompt_ids, n, history)
        own = len(prompts)
        if [x.row for x in carried] != list(range(own, own + len(carried))):
            raise ValueError(f"RolloutScheduler.submit: carried rows must be numbered from {own} on, got "
                             f"{[x.row for x in carried]}")
        rows_pred = np.concatenate([np.repeat(pred, n), np.full(len(carried), np.inf)])
        worker_rows = [list(r) for r in plan.worker_rows]
        by_load = np.argsort(plan.predicted_seconds, kind="stable")
        for e in range(len(carried)):
            worker_rows[int(by_load[e % len(by_load)])].append(own + e)
        local_rows = [np.asarray(r, np.int64) for r in worker_rows[self.first:self.first + self.local]]
        keys = [key if self.total == 1 else jax.random.fold_in(key, self.first + w) for w in range(self.local)]
        migration = None
        if c.mode == "histopipe" and c.migration and (defer or self.local > 1):
            migration = TailMigration(rows_pred, local_rows, growth=c.growth, tail_fraction=c.tail_fraction,
                                      defer=defer)
        all_prompts = list(prompts) + [list(x.prompt) for x in carried]
        row_ids = np.repeat(np.asarray(prompt_ids), n).tolist() + [int(x.prompt_idx) for x in carried]
        drafts = None
        if queued and drafter is not None:  # fixed now: later write-backs must not change them
            drafts = [drafter.batch([row_ids[r] for r in rows]) for rows in local_rows]
        job = StepWork(self.generate, states, local_rows, all_prompts, row_ids, sampling, keys, drafter=drafter,
                       migration=migration, carried={x.row: x for x in carried},
                       origin=self._origin if queued else None, draft_batches=drafts)
        pending = PendingRollout(step, plan, job, own, len(carried), time.perf_counter() - self._origin)
        if queued:
            if self.queues is None:
                self.queues = WorkerQueues(self.local)
            pending.futures = self.queues.submit(job)
            self._queued.append(pending)
        else:
            run_now(job)
        return pending

    def collect(self, pending: "PendingRollout") -> StepRollout:
        """Wait for a submitted step, gather it across processes and measure it.

        A queued step is measured over its window of the workers' continuous timeline: from its
        submission (or the previous queued step's end, if later) to its own end; time a worker
        spends in that window on the next queued step counts as busy (kind ``"next step"``), and
        so does a training update in it (``record_update``; kind ``"train"``).
        Intervals are returned relative to the window start.

        Raises:
          ValueError: a queued step collected out of submission order.
          The first exception a worker raised.
        """
        if pending.futures is not None:
            if not self._queued or self._queued[0] is not pending:
                raise ValueError(f"RolloutScheduler.collect: queued step {pending.step} collected out of order")
            for f in pending.futures:
                f.result()
            self._queued.pop(0)
        out = pending.job.result()
        plan, own = pending.plan, pending.own
        # Rows in step order across processes: gather (worker order), then sort by row.
        gathered_rows = _allgather_rows(out.rows)
        result = allgather_results(out.result, self.max_new_tokens)
        order = np.argsort(gathered_rows, kind="stable")
        result = RolloutResult([result.tokens[i] for i in order], [result.logprobs[i] for i in order],
                               [result.finish_reasons[i] for i in order], result.stats)
        deferred = _allgather_deferred(out.deferred, self.max_new_tokens, pending.job)
        intervals = out.intervals
        own_span = None
        if pending.futures is not None:
            if intervals:  # the step's own work, first start to last end (may overlap other steps)
                own_span = max(iv.end for iv in intervals) - min(iv.start for iv in intervals)
            intervals, bubble = self._window(pending, intervals)
        else:
            bubble = bubble_metrics(intervals, self.local) if intervals else {}
        total_rows = max(own, 1)
        metrics = {
            "sched/bubble_fraction": float(bubble.get("bubble_fraction", 0.0)),
            "sched/earliest_finisher_idle": float(bubble.get("earliest_finisher_idle", 0.0)),
            "time/rollout_makespan_s": float(bubble.get("makespan_s", 0.0)),
            "sched/migrated_share": len(out.migrated) / total_rows,
            "sched/deferred_share": len(deferred) / total_rows,
            "sched/continued_rows": float(pending.continued),
            "sched/predicted_makespan_s": float(np.max(plan.predicted_seconds)),
            "sched/ascending": float(bool(plan.ascending)) if plan.ascending is not None else -1.0,
            "sched/cross_step": float(pending.futures is not None),
        }
        if own_span is not None:
            metrics["time/rollout_own_s"] = float(own_span)
        finish = np.zeros(len(plan.groups))
        for iv in intervals:
            if iv.kind not in (NEXT_STEP, TRAIN):
                for g in plan.worker_groups[self.first + iv.worker]:
                    finish[g] = max(finish[g], iv.end)
        return dataclasses.replace(out, result=result, rows=np.sort(gathered_rows).astype(np.int64),
                                   intervals=intervals, deferred=deferred, metrics=metrics, plan=plan,
                                   group_finish_s=finish)

    def _window(self, pending: "PendingRollout", intervals: list[WorkerInterval]) -> tuple[list, dict]:
        """A queued step's intervals in its timeline window (relative to the window start) and
        its bubble metrics (``timeline.bubble_metrics`` with ``window=``)."""
        start = max(pending.submitted, self._last_end)
        end = max([start] + [iv.end for iv in intervals])
        self._last_end = max(self._last_end, end)
        ivs = [iv for iv in intervals if iv.end > start]
        for a, b in self._train:  # the update runs on every device: no worker is idle then
            if b > start and a < end:
                ivs += [WorkerInterval(w, a, b, TRAIN) for w in range(self.local)]
        self._train = [(a, b) for a, b in self._train if b > end]
        nxt = self._queued[0].job if self._queued else None
        if nxt is not None:  # the next step's work done in this window
            for w in range(self.local):
                began = nxt.started[w]
                if began is None or began >= end or not len(nxt.worker_rows[w]):
                    continue
                mine = [iv for iv in list(nxt.intervals) if iv.worker == w]
                stop = max([iv.end for iv in mine], default=end) if any(iv.kind == "batch" for iv in mine) else end
                ivs.append(WorkerInterval(w, began, min(max(stop, began), end), NEXT_STEP))
        shifted = [WorkerInterval(iv.worker, max(iv.start, start) - start, min(iv.end, end) - start, iv.kind,
                                  iv.source) for iv in ivs if min(iv.end, end) >= max(iv.start, start)]
        if not shifted:
            return [], {}
        return shifted, bubble_metrics(shifted, self.local, window=(0.0, end - start))

    def record_update(self, start: float, end: float) -> None:
        """Note that a training update ran from ``start`` to ``end`` (``time.perf_counter()``
        values) on the devices the workers share (the train mesh spans them all): queued steps'
        windows count that time as busy (kind ``"train"``), not as a bubble."""
        self._train.append((start - self._origin, end - self._origin))

    def close(self) -> None:
        """Stop the cross-step worker queues (queued jobs finish first)."""
        if self.queues is not None:
            self.queues.close()
            self.queues = None


@dataclasses.dataclass
class PendingRollout:
    """A submitted step (``RolloutScheduler.submit``): its plan, its per-worker job, the row
    counts, the submission time (seconds on the scheduler's clock) and, when queued, the workers'
    futures."""

    step: int
    plan: Plan
    job: StepWork
    own: int
    continued: int
    submitted: float
    futures: list | None = None


def _allgather_rows(rows: np.ndarray) -> np.ndarray:
    """Every process's row indices, concatenated in process order (padding dropped)."""
    if jax.process_count() == 1:
        return rows
    from jax.experimental import multihost_utils

    count = int(np.max(multihost_utils.process_allgather(np.int32(rows.size))))
    padded = np.full(count, -1, np.int64)
    padded[:rows.size] = rows
    allr = multihost_utils.process_allgather(padded).reshape(-1)
    return allr[allr >= 0]


def _allgather_deferred(local: Sequence[CarriedRow], max_new_tokens: int, job: StepWork) -> list[CarriedRow]:
    """Deferred rows of every process (in process order; ``job``: the step, whose prompts and
    prompt ids every process holds)."""
    rows = np.array([m.row for m in local], np.int64)
    packed = RolloutResult([m.tokens for m in local], [m.logprobs for m in local], ["migrated"] * len(local),
                           {k: 0 for k in COUNT_STATS})
    packed = allgather_results(packed, max_new_tokens)
    return [CarriedRow(int(r), int(job.prompt_ids[r]), np.asarray(job.prompts[r], np.int32), t, lp)
            for r, t, lp in zip(_allgather_rows(rows), packed.tokens, packed.logprobs)]

