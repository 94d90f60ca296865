"""L5 (suite ``longtail``, ``rhyme_lab/ablate/longtail.py``) at the tiny scale: the ledger task's
units run (warm start, the paired HistoSpec run, the second seed) and the report gives the
per-epoch lengths, the paired ratios, the HistoPipe replay with its Gantt plot and both seeds'
held-out gains."""

from __future__ import annotations

import numpy as np
import pytest

from rhyme_lab.ablate import longtail, registry


def test_length_stats():
    s = longtail.length_stats(np.array([[1, 2, 3, 4], [5, 6, 7, 1000]]))
    assert s["p50"] == 4.5 and s["max"] == 1000 and s["rows"] == 8
    assert s["p90"] == pytest.approx(np.percentile([1, 2, 3, 4, 5, 6, 7, 1000], 90))


@pytest.mark.slow  # three tiny runs of the ledger task (~1 min on 2 cores)
def test_tiny_longtail_suite(tmp_path, compile_cache):
    from rhyme_lab.ablate import runner
    from rhyme_lab.ablate.units import run_unit

    assert registry.units_of(["L5"]) == ["longtail_sft", "longtail_goodput_paired", "longtail_plain_seed1"]
    for name in registry.units_of(["L5"]):
        run_unit(name, tmp_path, "tiny")
    _, results = runner.run_suite("longtail", scale="tiny", out=tmp_path, only="L5", progress=False)
    r = results["L5"]
    assert r["status"] == "ok", r.get("reason")
    rows = r["epochs"]
    assert rows and all(x["rows"] > 0 and x["p50"] <= x["p90"] <= x["p99"] <= x["max"] for x in rows)
    assert all(0 < x["rollout_share"] < 1 and x["histospec_rollout"] > 0 for x in rows)
    assert set(r["held_out"]) == set(longtail.SEED_UNITS)
    assert r["histopipe"]["steps"] > 0 and r["histopipe"]["makespan_ratio"] > 0
    assert (tmp_path / "gantt_longtail.png").is_file()
    assert "| epoch | steps | reward | length p50" in r["details"]


def test_makespan_bound_is_the_longest_row_or_the_shared_work():
    cm = type("CM", (), {"a": 1.0, "b": 0.5, "c": 2.0})()
    # one long row: its own serial decode (1 + 0.5) x 100 + 2 bounds the step
    assert longtail.makespan_bound(np.array([100, 1, 1, 1]), cm, 4) == 152.0
    # many equal rows on 2 workers: the per-row work split evenly, (0.5 x 80 + 2 x 8) / 2 = 28 > 17
    assert longtail.makespan_bound(np.full(8, 10), cm, 2) == 28.0


def test_rollout_fit_recovers_the_pass_costs_of_the_runs_rollouts():
    """Steps whose plain rollouts took a * passes + b * row-passes + c * rows seconds (with a little
    noise) give back a, b, c; a negative least-squares coefficient is dropped to 0, not kept."""
    rng = np.random.default_rng(0)
    a, b, c = 0.005, 0.0005, 0.01
    steps = []
    for i in range(12):
        passes, row_steps = rng.integers(300, 4000), rng.integers(5000, 20000)
        seconds = (a * passes + b * row_steps + c * 64) * (1 + 0.01 * rng.standard_normal())
        steps.append({"step": i + 1, "plain": {"seconds": seconds, "forward_passes": passes,
                                               "sequence_steps": row_steps}})
    cm, r2, n = longtail.rollout_fit({"rows_per_step": 64, "steps": steps})
    assert n == 12 and r2 > 0.99
    assert cm.a == pytest.approx(a, rel=0.05) and cm.b == pytest.approx(b, rel=0.05)
    assert cm.c == pytest.approx(c, abs=0.01)
    # seconds falling with the passes: the pass coefficient would be negative, so it is 0
    flipped = [{"step": s["step"], "plain": {**s["plain"], "seconds": 30.0 - 0.005 * s["plain"]["forward_passes"]}}
               for s in steps]
    cm, _, _ = longtail.rollout_fit({"rows_per_step": 64, "steps": flipped})
    assert cm.a == 0.0 and cm.b >= 0.0 and cm.c >= 0.0
    assert longtail.rollout_fit({"rows_per_step": 64, "steps": steps[:2]}) is None
    model, source = longtail.cost_model({"rows_per_step": 64, "steps": steps}, 64.0)
    assert model.a == pytest.approx(a, rel=0.05) and "12 plain rollouts" in source


def test_oracle_grouped_is_the_best_contiguous_placement_and_above_the_bound():
    """Against brute force over every assignment of 7 rows to 3 workers: the oracle equals the best
    placement of contiguous runs of the sorted rows, is never below the true optimum or the bound."""
    import itertools

    from rhyme_jax.sched.cost_model import CostModel

    cm = CostModel(a=0.005, b=0.0005, c=0.01)
    lengths = np.array([659, 40, 310, 95, 95, 12, 200], np.float64)

    def worker_cost(rows):
        return cm.decode_cost(lengths[list(rows)]) if len(rows) else 0.0

    best_any = min(max(worker_cost([i for i in range(7) if a[i] == w]) for w in range(3))
                   for a in itertools.product(range(3), repeat=7))
    order = np.argsort(-lengths)
    best_contiguous = min(max(worker_cost(order[i:j]) for i, j in zip((0, *cuts), (*cuts, 7)))
                          for cuts in itertools.combinations_with_replacement(range(8), 2) if cuts[0] <= cuts[1])
    got = longtail.oracle_grouped(lengths, cm, 3)
    assert got == pytest.approx(best_contiguous)
    assert got >= best_any - 1e-12 and got >= longtail.makespan_bound(lengths, cm, 3) - 1e-12
    # a-dominated: the longest row alone on its worker beats spreading the rows evenly
    even = max(worker_cost(list(order[w::3])) for w in range(3))
    assert got < even
