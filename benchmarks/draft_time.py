"""Host time of ``DraftBatch.draft`` / ``observe`` per step at 128 live rows (issue 16 target:
drafting <= 2% of rollout time on CPU, where a demo step takes ~3-10 ms).

A synthetic rhyming workload like the CPU demo's: ``--prompts`` prompts x ``--group`` samples (16 x
8 = 128 rows), ~60-token answers that are small edits of one answer per prompt; the history holds
one earlier rollout of each prompt. Every step drafts for all live rows, accepts a draft token iff
it equals the target's next token (each pass emits the accepted tokens plus one) and observes,
exactly as the engine's loop does (all drafted tokens are sent: no allocation;
``rhyme_lab.measure.draft_cost``). Prints, per policy,
the median and p90 of draft() and observe() microseconds per step (the first step apart: it seeds
the sequence store), the median draft() time over the steps with all rows live
(``draft_us_all_rows``), steps, the share of target tokens accepted from drafts and, for goodput,
the calibration's pooled predicted vs observed acceptance of the tested draft tokens. Host timings
on a shared machine are noisy: compare policies within one run.

    python -m benchmarks.draft_time [--prompts 16 --group 8 --rounds 3]
"""

from __future__ import annotations

import argparse

from rhyme_lab.measure.draft_cost import draft_times


def main(argv=None) -> None:
    """Command line (module docstring): one line per policy and round."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    variants = [("aimd", {}), ("goodput", {}), ("goodput", dict(self_lookup=True, siblings=True))]
    for policy, extra in variants:
        draft_times(policy, 4, 8, 99, **extra)  # compile / load the numba cache
        for seed in range(a.rounds):
            r = draft_times(policy, a.prompts, a.group, seed, **extra)
            print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
