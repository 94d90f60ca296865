"""Host time of ``DraftBatch.draft`` / ``observe`` per step at 128 live rows (issue 16 target:
drafting <= 2% of rollout time on CPU, where a demo step takes ~3-10 ms).

A synthetic rhyming workload like the CPU demo's: ``--prompts`` prompts x ``--group`` samples (16 x
8 = 128 rows), ~60-token answers that are small edits of one answer per prompt; the history holds
one earlier rollout of each prompt. Every step drafts for all live rows, accepts a draft token iff
it equals the target's next token (each pass emits the accepted tokens plus one) and observes,
exactly as the engine's loop does (all drafted tokens are sent: no allocation). Prints, per policy,
the median and p90 of draft() and observe() microseconds per step (the first step apart: it seeds
the sequence store), the median draft() time over the steps with all rows live
(``draft_us_all_rows``), steps, the share of target tokens accepted from drafts and, for goodput,
the calibration's pooled predicted vs observed acceptance of the tested draft tokens. Host timings
on a shared machine are noisy: compare policies within one run.

    python benchmarks/draft_time.py [--prompts 16 --group 8 --rounds 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from rhyme_jax.config import SpecSection
from rhyme_jax.spec.drafter import Drafter
from rhyme_jax.spec.history import HistoryStore

VOCAB = 400


def workload(rng, prompts: int, group: int):
    """(prompt tokens per prompt, history responses, target responses), answers ~60 tokens."""
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


def run(policy: str, prompts: int, group: int, seed: int, **extra) -> dict:
    rng = np.random.default_rng(seed)
    ps, hist, targets = workload(rng, prompts, group)
    store = HistoryStore()
    ids = np.repeat(np.arange(prompts), group)
    store.update(0, ids, [ps[p] for p in ids], [r for p in range(prompts) for r in hist[p]], rng.random(ids.size))
    cfg = SpecSection(window=policy, **extra)  # the paper's settings (the section's defaults) but the window
    seqs = [np.r_[ps[p], t] for p in range(prompts) for t in targets[p]]
    starts = np.array([ps[p].size for p in ids])
    done = starts + 1  # prefill emitted the first token
    t_draft, t_obs, acc, t_full = [], [], 0, []
    with Drafter(cfg, store) as d:
        d.rebuild(range(prompts))
        b = d.batch(ids.tolist())
        w = b.context_width
        while True:
            live = np.flatnonzero(done < np.array([s.size for s in seqs]))
            if live.size == 0:
                break
            tails = np.full((live.size, w), -1, np.int32)
            for i, r in enumerate(live):
                t = seqs[r][max(0, done[r] - w): done[r]]
                tails[i, w - t.size:] = t
            budgets = np.array([seqs[r].size - done[r] - 1 for r in live])
            t0 = time.perf_counter()
            drafts, lens = b.draft(live, tails, budgets)
            t1 = time.perf_counter()
            accepted = np.zeros(live.size, np.int64)
            for i, r in enumerate(live):
                nxt = seqs[r][done[r]: done[r] + lens[i]]
                eq = drafts[i, : nxt.size] == nxt
                accepted[i] = nxt.size if eq.all() else int(np.argmin(eq))
            t2 = time.perf_counter()
            b.observe(live, lens, accepted)
            t_obs.append(time.perf_counter() - t2)
            t_draft.append(t1 - t0)
            if live.size == len(seqs) and len(t_draft) > 1:
                t_full.append(t1 - t0)
            acc += int(accepted.sum())
            done[live] += accepted + 1
        cal = d.calibration()
    total = sum(s.size for s in seqs) - int(starts.sum())
    td, to = np.array(t_draft[1:]) * 1e6, np.array(t_obs[1:]) * 1e6
    return dict(policy=policy + "".join(f"+{k}" for k, v in extra.items() if v), steps=len(t_draft),
                draft_us_median=float(np.median(td)), draft_us_p90=float(np.percentile(td, 90)),
                draft_us_all_rows=float(np.median(t_full) * 1e6) if t_full else float("nan"),
                first_step_us=float(t_draft[0] * 1e6), observe_us_median=float(np.median(to)),
                accepted_share=acc / total, **_pooled(cal))


def _pooled(rows: list[dict]) -> dict:
    """Predicted vs observed acceptance pooled over the calibration table's tested tokens."""
    t = sum(r["trials"] for r in rows)
    if not t:
        return {}
    return dict(predicted=sum(r["predicted"] * r["trials"] for r in rows) / t,
                observed=sum(r["observed"] * r["trials"] for r in rows) / t, tested=t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    variants = [("aimd", {}), ("goodput", {}), ("goodput", dict(self_lookup=True, siblings=True))]
    for policy, extra in variants:
        run(policy, 4, 8, 99, **extra)  # compile / load the numba cache
        for seed in range(a.rounds):
            r = run(policy, a.prompts, a.group, seed, **extra)
            print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
