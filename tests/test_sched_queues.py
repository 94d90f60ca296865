"""Cross-step worker queues (``sched.cross_step``; issue 6): a worker starts its part of the next
step as soon as its own part of the current step is done, and the queued step's bubble metrics
count that work as busy. Fake engines that sleep stand in for real ones, so the order of events
is what is checked; no timing is asserted beyond it (margins of several times the sleeps)."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest

from rhyme_jax.config import SchedSection
from rhyme_jax.rollout.gather import COUNT_STATS
from rhyme_jax.rollout.types import RolloutResult, SamplingParams
from rhyme_jax.sched.cost_model import DEFAULT_COST_MODEL
from rhyme_jax.sched.scheduler import RolloutScheduler
from rhyme_jax.sched.timeline import NEXT_STEP, WorkerInterval, bubble_metrics


class SleepEngine:
    """``generate`` sleeps the longest ``prompt[0]`` milliseconds of its batch and answers each
    prompt with itself."""

    def __init__(self):
        self.drafts = []  # the draft batch each generate call got

    def generate(self, state, prompts, sampling, key, drafter=None, prefixes=None, monitor=None, on_stop=None):
        self.drafts.append(drafter)
        time.sleep(max(p[0] for p in prompts) / 1000)
        stats = {k: 0 for k in COUNT_STATS}
        stats["forward_passes"] = 1
        return RolloutResult([np.asarray(p, np.int32) for p in prompts],
                             [np.zeros(len(p), np.float32) for p in prompts], ["length"] * len(prompts), stats)


def Sched():  # noqa: N802 (the sched config section these tests run under)
    return SchedSection(mode="fifo", pipeline="one_step_off", cross_step=True, migration=False)


def _submit(sch, step, ms, queued, drafter=None):
    """A step of one prompt per worker (fifo puts prompt w on worker w), worker w sleeping ms[w]."""
    return sch.submit(step, [None] * len(ms), list(range(len(ms))), [[m] for m in ms], 1,
                      SamplingParams(temperature=0.0, max_new_tokens=4), jax.random.key(0), queued=queued,
                      drafter=drafter)


class VersionDrafter:
    """``batch`` answers with the history version it saw."""

    version = 0

    def batch(self, prompt_ids):
        return (self.version, tuple(prompt_ids))


def test_queued_drafts_come_from_the_history_at_submission():
    """A write-back between a queued step's submission and its job's start must not change its
    drafts (else sampled tokens would depend on thread timing)."""
    engines = [SleepEngine(), SleepEngine()]
    sch = RolloutScheduler(engines, Sched(), 4)
    drafter = VersionDrafter()
    try:
        first = _submit(sch, 1, [300, 300], queued=True)
        second = _submit(sch, 2, [10, 10], queued=True, drafter=drafter)
        drafter.version = 1  # a write-back while step 1 still runs
        sch.collect(first)
        sch.collect(second)
    finally:
        sch.close()
    assert [e.drafts for e in engines] == [[None, (0, (0,))], [None, (0, (1,))]]


def test_worker_goes_on_to_the_next_step_while_others_run():
    sch = RolloutScheduler([SleepEngine(), SleepEngine()], Sched(), 4)
    assert sch.cost_model == DEFAULT_COST_MODEL
    try:
        first = _submit(sch, 1, [50, 600], queued=True)  # worker 0 short, worker 1 long
        second = _submit(sch, 2, [800, 50], queued=True)  # complementary (the odd/even idea)
        with pytest.raises(ValueError, match="out of order"):
            sch.collect(second)
        r1 = sch.collect(first)
        r2 = sch.collect(second)
    finally:
        sch.close()
    # The rows come back whole and in order, each step's own.
    assert [t.tolist() for t in r1.result.tokens] == [[50], [600]]
    assert [t.tolist() for t in r2.result.tokens] == [[800], [50]]
    # Worker 0 started step 2 during step 1 (well before worker 1's 600 ms ended) ...
    nxt = [iv for iv in r1.intervals if iv.kind == NEXT_STEP]
    assert [iv.worker for iv in nxt] == [0]
    own1 = {iv.worker: iv for iv in r1.intervals if iv.kind != NEXT_STEP}
    assert nxt[0].start < 0.3 * own1[1].end and nxt[0].end == pytest.approx(r1.metrics["time/rollout_makespan_s"])
    # ... so in step 1's window worker 0 idles only between its two jobs: bubble well under the
    # 1 - (50 + 600) / 1200 = 46% a barrier would leave, and the earliest finisher is not idle.
    assert r1.metrics["sched/bubble_fraction"] < 0.1
    assert r1.metrics["sched/earliest_finisher_idle"] < 0.1
    assert r1.metrics["sched/cross_step"] == 1.0
    # Step 2's window starts at step 1's end: worker 0's remaining step-2 work is in it.
    assert r2.metrics["time/rollout_makespan_s"] < 0.45  # 50 + 800 - 600 ms nominal
    assert all(iv.start >= 0 for iv in r2.intervals)


def test_sync_submission_keeps_the_barrier():
    sch = RolloutScheduler([SleepEngine(), SleepEngine()], Sched(), 4)
    r = sch.collect(_submit(sch, 1, [50, 600], queued=False))
    assert r.metrics["sched/cross_step"] == 0.0 and not [iv for iv in r.intervals if iv.kind == NEXT_STEP]
    assert r.metrics["sched/bubble_fraction"] > 0.3  # worker 0 waits for worker 1


def test_bubble_metrics_in_a_window():
    """Clipping to the window, next-step work counted busy, the earliest finisher by own work."""
    ivs = [WorkerInterval(0, -2, 3), WorkerInterval(0, 5, 10, NEXT_STEP), WorkerInterval(1, 0, 10),
           WorkerInterval(2, 1, 4)]
    m = bubble_metrics(ivs, 3, window=(0.0, 10.0))
    assert m["makespan_s"] == 10 and m["busy_s"] == [8, 10, 3]
    assert m["bubble_fraction"] == pytest.approx(1 - 21 / 30)
    # worker 0 finishes its own work first (t=3) and then idles 2 of the 7 s left
    assert m["earliest_finisher"] == 0 and m["earliest_finisher_idle"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="window"):
        bubble_metrics(ivs, 3, window=(1.0, 0.0))


def test_training_update_in_a_window_is_not_a_bubble():
    """Workers and the trainer share the devices: a recorded update is busy time for every worker
    in the queued step's window (kind "train")."""
    sch = RolloutScheduler([SleepEngine(), SleepEngine()], Sched(), 4)
    try:
        pending = _submit(sch, 1, [50, 600], queued=True)
        now = time.perf_counter()
        sch.record_update(now + 0.05, now + 0.45)  # worker 0 would idle from ~50 ms to 600 ms
        r = sch.collect(pending)
    finally:
        sch.close()
    train = [iv for iv in r.intervals if iv.kind == "train"]
    assert sorted(iv.worker for iv in train) == [0, 1]
    assert train[0].end - train[0].start == pytest.approx(0.4, abs=0.02)
    assert r.metrics["sched/bubble_fraction"] < 0.25  # 1 - (0.6 + 0.45) / 1.2 nominal; 46% without


def test_wrap_generate_hook_sees_every_engine_call():
    """``RolloutScheduler(wrap_generate=)`` puts a hook around each worker's engine calls (what
    ``benchmarks.rollout`` pairs plain and HistoSpec rollouts with): it gets the call's arguments
    and its return value is the rollout."""
    calls = []

    def wrap(generate):
        def hooked(state, prompts, sampling, key, **kw):
            calls.append((state, [list(p) for p in prompts], sorted(kw)))
            return generate(state, prompts, sampling, key, **kw)
        return hooked

    sch = RolloutScheduler([SleepEngine(), SleepEngine()], Sched(), 4, wrap_generate=wrap)
    r = sch.collect(_submit(sch, 1, [5, 7], queued=False))
    assert [t.tolist() for t in r.result.tokens] == [[5], [7]]
    assert sorted(c[1] for c in calls) == [[[5]], [[7]]]
    assert all(c[2] == ["drafter", "monitor", "on_stop", "prefixes"] for c in calls)
