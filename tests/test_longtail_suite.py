"""L5 (suite ``longtail``, ``rhyme_lab/ablate/longtail.py``) at the tiny scale: the ledger task's
units run (warm start, the paired HistoSpec run, the second seed) and the report gives the
per-epoch lengths, the paired ratios, the HistoPipe replay with its Gantt plot and both seeds'
held-out gains; L6 (suite ``longtail_recur``) gives the same over its paired learning run."""

from __future__ import annotations

import numpy as np
import pytest

from rhyme_lab.ablate import longtail, registry


def test_length_stats():
    s = longtail.length_stats(np.array([[1, 2, 3, 4], [5, 6, 7, 1000]]))
    assert s["p50"] == 4.5 and s["max"] == 1000 and s["rows"] == 8
    assert s["p90"] == pytest.approx(np.percentile([1, 2, 3, 4, 5, 6, 7, 1000], 90))


@pytest.mark.slow  # five tiny runs of the ledger task (~1 min on 2 cores)
def test_tiny_longtail_suite(tmp_path, compile_cache):
    from rhyme_lab.ablate import runner
    from rhyme_lab.ablate.units import run_unit

    assert registry.units_of(["L5"]) == ["longtail_sft", "longtail_goodput_paired", "longtail_plain_seed0",
                                             "longtail_plain_seed1"]
    for name in registry.units_of(["L5"]):
        run_unit(name, tmp_path, "tiny")
    _, results = runner.run_suite("longtail", scale="tiny", out=tmp_path, only="L5", progress=False)
    r = results["L5"]
    assert r["status"] == "ok", r.get("reason")
    rows = r["epochs"]
    assert rows and all(x["rows"] > 0 and x["p50"] <= x["p90"] <= x["p99"] <= x["max"] for x in rows)
    assert all(0 < x["rollout_share"] < 1 and x["histospec_rollout"] > 0 for x in rows)
    assert set(r["held_out"]) == set(longtail.SEED_UNITS)
    before = {u: r["held_out"][u]["before"] for u in longtail.SEED_UNITS}
    assert len(set(before.values())) == 1, before  # one evaluation of the warm start, shared by the seeds
    assert len(list((tmp_path / "runs" / "longtail_sft" / "sft" / "held_out_before").glob("*.json"))) == 1
    assert r["histopipe"]["steps"] > 0 and r["histopipe"]["makespan_ratio"] > 0
    assert (tmp_path / "gantt_longtail.png").is_file()
    assert "| epoch | steps | reward | length p50" in r["details"]
    # L6: the run that learns and recurs, paired, with its own held-out gain from the same evaluation
    assert registry.units_of(["L6"]) == ["longtail_sft", "longtail_recur_paired"]
    run_unit("longtail_recur_paired", tmp_path, "tiny")
    _, results = runner.run_suite("longtail_recur", scale="tiny", out=tmp_path, only="L6", progress=False)
    r6 = results["L6"]
    assert r6["status"] == "ok", r6.get("reason")
    assert list(r6["held_out"]) == [longtail.RECUR_UNIT] and r6["held_out"][longtail.RECUR_UNIT]["before"] in set(before.values())
    assert len(r6["epochs"]) == 3 and all(x["histospec_rollout"] > 0 for x in r6["epochs"])
    assert len(list((tmp_path / "runs" / "longtail_sft" / "sft" / "held_out_before").glob("*.json"))) == 1
    assert (tmp_path / "gantt_longtail_recur.png").is_file()
    composed = r6["whole_system"]  # epochs whose steps the replay covers (prompts with history)
    assert composed and all(x["system"] > 0 and x["histopipe"] > 0 for x in composed.values())
    assert r6["flops"] and all(x["rollout_gflops"] > 0 and x["gap"] > 0 for x in r6["flops"])  # regime_flops
    # L7: L6 with run seed 1, and both seeds' held-out gain pooled per problem
    run_unit("longtail_recur_seed1_paired", tmp_path, "tiny")
    _, results = runner.run_suite("longtail_recur_seed1", scale="tiny", out=tmp_path, only="L7", progress=False)
    r7 = results["L7"]
    assert r7["status"] == "ok", r7.get("reason")
    assert r7["pooled_held_out"]["seeds"] == 2 and r7["pooled_held_out"]["before"] in set(before.values())
    assert (tmp_path / "gantt_longtail_recur_seed1.png").is_file()


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


def test_held_out_gains_greedy_and_sampled_paired(tmp_path):
    """The per-problem eval files of a run give the paired greedy gain and, where the run sampled,
    the paired mean@k gain: mean of the per-problem differences, their standard error and z."""
    from rhyme_jax.io.summary import eval_path
    from rhyme_jax.train.evaluate import EvalResult

    def save(step, correct, sampled):
        c = np.asarray(correct, float)
        EvalResult(float(c.mean()), 0.0, c.size, 10.0, c, samples=4,
                   sampled_per_problem=np.asarray(sampled, float)).save(eval_path(tmp_path, step))

    save(0, [1, 0, 0, 1], [0.5, 0.0, 0.25, 0.75])
    save(6, [1, 1, 0, 1], [1.0, 0.25, 0.5, 0.75])
    g = longtail.held_out(tmp_path, 6)
    assert (g["before"], g["after"], g["n"]) == (0.5, 0.75, 4) and g["gain"] == 0.25
    assert g["se"] == pytest.approx(np.std([0, 1, 0, 0], ddof=1) / 2)
    s = g["sampled"]
    d = np.array([0.5, 0.25, 0.25, 0.0])
    assert s["gain"] == pytest.approx(d.mean()) and s["z"] == pytest.approx(d.mean() / (d.std(ddof=1) / 2))
    assert longtail.held_out(tmp_path, 7) is None


def test_oracle_prompts_is_the_best_placement_of_whole_prompts():
    """Against brute force over every assignment of 5 prompts (3 samples each) to 3 workers: the
    subset DP gives the best whole-prompt makespan, never below the bound on any placement, and
    above the best row-level contiguous placement when one prompt holds both a long and short rows."""
    import itertools

    from rhyme_jax.sched.cost_model import CostModel

    cm = CostModel(a=0.005, b=0.0005, c=0.01)
    lengths = np.array([[659, 40, 12], [310, 95, 95], [200, 30, 31], [20, 22, 25], [90, 400, 15]], np.float64)

    def worker_cost(prompts):
        return cm.decode_cost(lengths[list(prompts)].ravel()) if len(prompts) else 0.0

    brute = min(max(worker_cost([p for p in range(5) if a[p] == w]) for w in range(3))
                for a in itertools.product(range(3), repeat=5))
    got = longtail.oracle_prompts(lengths, cm, 3)
    assert got == pytest.approx(brute)
    assert got >= longtail.makespan_bound(lengths, cm, 3) - 1e-12
    assert got > longtail.oracle_grouped(lengths, cm, 3)  # the rows of a prompt, split by length, do better
    assert longtail.oracle_prompts(lengths[:1], cm, 3) == pytest.approx(worker_cost([0]))
    with pytest.raises(ValueError, match="13 prompts"):
        longtail.oracle_prompts(np.ones((13, 2)), cm, 4)
    from rhyme_jax.sched.exact_placement import best_subsets

    _, masks = best_subsets(lengths, cm, 3)
    assert len(masks) <= 3 and sum(masks) == 31 and all(not masks[i] & masks[j] for i in range(len(masks)) for j in range(i))


def test_length_rhyme_ranks_prompts_by_their_last_rollout():
    """Prompts whose lengths keep their order between epochs correlate at 1; a row longer than twice
    its prompt's previous longest row counts as an unpredicted tail."""
    from rhyme_lab.schedule.replay import StepLengths

    ids = np.arange(4)
    first = np.array([[10, 12], [50, 40], [100, 90], [300, 200]])
    second = np.array([[11, 13], [45, 60], [120, 80], [250, 4096]])
    r = longtail.length_rhyme([StepLengths(1, ids, first), StepLengths(2, ids, second)])
    assert r["prompts"] == 4 and r["spearman_mean"] == pytest.approx(1.0) and r["spearman_max"] == pytest.approx(1.0)
    assert r["rows_over_2x_prev_max"] == pytest.approx(1 / 8)
    flipped = longtail.length_rhyme([StepLengths(1, ids, first), StepLengths(2, ids, first[::-1])])
    assert flipped["spearman_mean"] == pytest.approx(-1.0)
    assert longtail.length_rhyme([StepLengths(1, ids, first)])["spearman_mean"] is None


def test_histospec_bound_is_the_plain_over_oracle_rollout_time():
    """The bound unit's steps after the compiling one: plain / oracle and plain / own drafter
    seconds as ratios of sums, and the own drafter's share of the bound."""
    def step(i, plain, own, oracle):
        return {"step": i, **{k: {"seconds": v, "forward_passes": 10 * v} for k, v in
                              (("plain", plain), ("own", own), ("spec", oracle))}}

    r = {"skip": 1, "steps": [step(1, 99.0, 1.0, 1.0), step(2, 10.0, 8.0, 5.0), step(3, 20.0, 17.0, 10.0)]}
    b = longtail.histospec_bound(r)
    assert b["steps"] == 2 and b["bound"] == pytest.approx(2.0) and b["own"] == pytest.approx(30 / 25)
    assert b["of_bound"] == pytest.approx(0.6) and b["passes_plain"] == 300
    assert longtail.histospec_bound({"steps": [step(1, 1.0, 1.0, 1.0)]}) is None


def test_history_dp_plans_from_the_last_rollout_and_is_timed_on_the_true_lengths():
    """Steps 1 and 2 hold the same prompts; step 2's plan comes from step 1's lengths. With the same
    lengths again it is the clairvoyant whole-prompt placement; with the prompts' lengths swapped it
    is that plan timed on the swapped lengths (worse); a step with an unseen prompt is not planned."""
    from rhyme_jax.sched.cost_model import CostModel
    from rhyme_lab.schedule.replay import StepLengths

    cm = CostModel(a=0.005, b=0.0005, c=0.01)
    x = np.array([[900, 40], [300, 95], [200, 30], [20, 22], [90, 40]], np.float64)
    ids = np.arange(5)
    same = longtail.history_dp([StepLengths(1, ids, x), StepLengths(2, ids, x)], cm, 2)
    assert list(same) == [2] and same[2] == pytest.approx(longtail.oracle_prompts(x, cm, 2))
    swapped = longtail.history_dp([StepLengths(1, ids, x), StepLengths(2, ids, x[::-1])], cm, 2)
    assert swapped[2] > longtail.oracle_prompts(x[::-1], cm, 2)
    assert longtail.history_dp([StepLengths(1, ids, x), StepLengths(2, ids + 1, x)], cm, 2) == {}


def test_whole_system_composes_measured_histospec_with_replayed_makespans():
    """compose.whole_system: per epoch, (rest + fifo makespan) over (rest + spread makespan x the
    step's measured HistoSpec ratio), ratios of sums over the replayed timed steps; steps the
    replay skipped (no history) and the compiling step are left out."""
    from rhyme_lab.ablate import compose

    def step(i, ep, plain, spec, rest):
        return {"step": i, "rollout/epoch": ep, "plain": {"seconds": plain}, "spec": {"seconds": spec},
                "wall_s": plain + spec + rest}

    r = {"skip": 1, "steps": [step(1, 1, 50.0, 50.0, 9.0), step(2, 1, 10.0, 10.0, 2.0),
                              step(3, 2, 10.0, 5.0, 2.0), step(4, 2, 20.0, 8.0, 4.0)]}
    spans = {3: {"fifo": 8.0, "spread": 4.0}, 4: {"fifo": 16.0, "spread": 12.0}, 1: {"fifo": 1.0, "spread": 1.0}}
    out = compose.whole_system(r, spans)
    assert list(out) == [2]  # step 1 compiles (skip), step 2 has no replay
    x = out[2]
    system = (2 + 8 + 4 + 16) / (2 + 4 * 0.5 + 4 + 12 * 0.4)
    assert x["steps"] == 2 and x["system"] == pytest.approx(system)
    assert x["histopipe"] == pytest.approx(30 / 22) and x["histospec"] == pytest.approx(30 / 13)
    assert x["rollout_share_fifo"] == pytest.approx(24 / 30) and x["system_se"] > 0
    assert "epoch 2: " in compose.cell(out) and compose.cell({}) is None


def test_pooled_gain_averages_the_seeds_per_problem(tmp_path):
    """seeds.pooled_gain: per problem the seeds' mean after less the shared before, its paired SE;
    None below two evaluated seeds; seeds with different befores (warm starts from different
    machines) pool as independent gains; another number of problems is refused."""
    from rhyme_jax.io.summary import eval_path
    from rhyme_lab.ablate import seeds

    before = np.array([0, 0, 1, 1, 0, 1, 0, 0], np.float64)
    afters = [np.array([1, 0, 1, 1, 1, 1, 0, 0.]), np.array([1, 1, 1, 0, 0, 1, 0, 1.])]
    runs = []
    for i, after in enumerate(afters):
        d = tmp_path / f"seed{i}"
        for step, x in ((0, before), (3, after)):
            eval_path(d, step).parent.mkdir(parents=True, exist_ok=True)
            np.savez(eval_path(d, step), correct=x, sampled=np.zeros(0))
        runs.append((d, 3))
    g = seeds.pooled_gain(runs)
    diff = (afters[0] + afters[1]) / 2 - before
    assert g["seeds"] == 2 and g["n"] == 8 and g["gain"] == pytest.approx(diff.mean())
    assert g["se"] == pytest.approx(diff.std(ddof=1) / np.sqrt(8)) and g["z"] == pytest.approx(g["gain"] / g["se"])
    assert seeds.pooled_gain(runs[:1]) is None and seeds.pooled_gain(runs + [(tmp_path / "none", 3)])["seeds"] == 2
    assert g["pooling"] == "per problem"
    other = 1 - before  # seed 1 from another warm start
    np.savez(eval_path(runs[1][0], 0), correct=other, sampled=np.zeros(0))
    g = seeds.pooled_gain(runs)
    d0, d1 = afters[0] - before, afters[1] - other
    se = np.hypot(d0.std(ddof=1), d1.std(ddof=1)) / np.sqrt(8) / 2
    assert g["pooling"] == "independent" and g["gain"] == pytest.approx((d0.mean() + d1.mean()) / 2)
    assert g["se"] == pytest.approx(se) and g["before"] == pytest.approx(0.5)
    np.savez(eval_path(runs[1][0], 0), correct=before[:6], sampled=np.zeros(0))
    with pytest.raises(ValueError, match="6 problems"):
        seeds.pooled_gain(runs)
