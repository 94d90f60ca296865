"""Host time of ``DraftBatch.draft`` / ``observe`` per step at 128 live rows (issue 16 target:
drafting <= 2% of rollout time on CPU, where a demo step takes ~3-10 ms).

``workload`` is a synthetic rhyming workload like the CPU demo's: ``prompts`` prompts x ``group``
samples, ~60-token answers that are small edits of one answer per prompt; the history holds one
earlier rollout of each prompt. ``draft_times`` drafts along the targets with
``draft_replay.drive`` (the prefill emitted each first token; every drafted token is sent, no
allocation; a draft token is accepted iff it equals the target's next token) through a
``TimedBatch``, which clocks each ``draft`` and ``observe`` call. ``python -m
benchmarks.draft_time`` is the command line. Host timings on a shared machine are noisy: compare
policies within one run.
"""

from __future__ import annotations

import time

import numpy as np

from rhyme_jax.config import SpecSection
from rhyme_lab.measure.draft_replay import drive
from rhyme_jax.spec.drafter import Drafter
from rhyme_jax.spec.history import HistoryStore

VOCAB = 400


def workload(rng: np.random.Generator, prompts: int, group: int):
    """``(prompt tokens per prompt, history responses, target responses)`` (``int64`` arrays;
    responses per prompt, ``group`` each), prompts 40 tokens, answers 50..65 tokens."""
    ps = [rng.integers(0, VOCAB, 40) for _ in range(prompts)]
    base = [rng.integers(0, VOCAB, 60) for _ in range(prompts)]

    def edit(b):
        r = b.copy()
        k = rng.integers(1, 6)
        r[rng.integers(0, r.size, k)] = rng.integers(0, VOCAB, k)
        return r[: rng.integers(50, 66)]

    hist = [[edit(base[p]) for _ in range(group)] for p in range(prompts)]
    targets = [[edit(base[p]) for _ in range(group)] for p in range(prompts)]
    return ps, hist, targets


class TimedBatch:
    """A ``DraftBatch`` wrapper that clocks its calls: ``draft_s`` / ``observe_s`` (seconds per
    call), ``rows`` (live rows per ``draft`` call) and ``accepted`` (tokens accepted in all)."""

    def __init__(self, batch):
        self.batch, self.context_width = batch, batch.context_width
        self.draft_s: list[float] = []
        self.observe_s: list[float] = []
        self.rows: list[int] = []
        self.accepted = 0

    def draft(self, reqs, tails, budgets):
        """The wrapped batch's ``draft``, timed."""
        t0 = time.perf_counter()
        out = self.batch.draft(reqs, tails, budgets)
        self.draft_s.append(time.perf_counter() - t0)
        self.rows.append(len(reqs))
        return out

    def observe(self, reqs, lens, accepted) -> None:
        """The wrapped batch's ``observe``, timed."""
        t0 = time.perf_counter()
        self.batch.observe(reqs, lens, accepted)
        self.observe_s.append(time.perf_counter() - t0)
        self.accepted += int(np.sum(accepted))


def draft_times(policy: str, prompts: int, group: int, seed: int, **extra) -> dict:
    """Draft along a ``workload(default_rng(seed), prompts, group)`` with ``SpecSection(window=
    policy, **extra)`` (the paper's settings otherwise).

    Returns ``policy`` (with the ``extra`` flags set), ``steps``, the median and p90 of draft()
    microseconds per step and the median of observe() (the first step apart: it seeds the
    sequence store; ``first_step_us``), ``draft_us_all_rows`` (median draft() with every row
    live), ``accepted_share`` (accepted draft tokens / target tokens) and, where the drafter
    calibrates (goodput), ``predicted`` / ``observed`` acceptance pooled over ``tested`` tokens.
    """
    rng = np.random.default_rng(seed)
    ps, hist, targets = workload(rng, prompts, group)
    store = HistoryStore()
    ids = np.repeat(np.arange(prompts), group)
    store.update(0, ids, [ps[p] for p in ids], [r for p in range(prompts) for r in hist[p]], rng.random(ids.size))
    cfg = SpecSection(window=policy, **extra)  # the paper's settings (the section's defaults) but the window
    rows = [ps[p] for p in ids]
    answers = [t for p in range(prompts) for t in targets[p]]
    with Drafter(cfg, store) as d:
        d.rebuild(range(prompts))
        timed = TimedBatch(d.batch(ids.tolist()))
        drive(timed, rows, answers, emitted=1)
        cal = d.calibration()
    total = sum(a.size for a in answers)
    td, to = np.array(timed.draft_s[1:]) * 1e6, np.array(timed.observe_s[1:]) * 1e6
    full = [t for i, (t, n) in enumerate(zip(timed.draft_s, timed.rows)) if n == len(answers) and i > 0]
    return dict(policy=policy + "".join(f"+{k}" for k, v in extra.items() if v), steps=len(timed.draft_s),
                draft_us_median=float(np.median(td)), draft_us_p90=float(np.percentile(td, 90)),
                draft_us_all_rows=float(np.median(full) * 1e6) if full else float("nan"),
                first_step_us=float(timed.draft_s[0] * 1e6), observe_us_median=float(np.median(to)),
                accepted_share=timed.accepted / total, **pooled_calibration(cal))


def pooled_calibration(rows: list[dict]) -> dict:
    """Predicted vs observed acceptance pooled over the calibration table's tested tokens
    (``Drafter.calibration()`` rows: ``trials``, ``predicted``, ``observed``); ``{}`` untested."""
    t = sum(r["trials"] for r in rows)
    if not t:
        return {}
    return dict(predicted=sum(r["predicted"] * r["trials"] for r in rows) / t,
                observed=sum(r["observed"] * r["trials"] for r in rows) / t, tested=t)
