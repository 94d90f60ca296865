"""HistoPipe host-side math: length predictor, cost model, planner (tier 1/2), bubble metrics, Gantt,
and the replay benchmark's worker simulation (docs/architecture.md, "HistoPipe")."""

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from rhyme_lab.schedule import replay as replay_bench
from rhyme_jax.sched.cost_model import CostModel, CostModelError
from rhyme_jax.sched.length_predictor import predict_lengths
from rhyme_jax.sched.planner import (
    allocate_workers, check_plan, max_worker_rows, plan_step, ranking_groups, rows_per_worker)
from rhyme_jax.sched.timeline import WorkerInterval, bubble_metrics, plot_gantt, select_steps
from rhyme_jax.spec.history import HistoryStore

ROOT = Path(__file__).resolve().parents[1]
COST = CostModel(a=1e-3, b=2e-5, c=1e-3)


# ----------------------------------------------------------------------------- length predictor
def _store():
    h = HistoryStore()
    resp = [np.zeros(k, np.int32) for k in (2, 4, 6, 8, 10, 10, 10, 20)]
    h.update(1, np.array([1, 1, 1, 1, 2, 2, 2, 2]), [np.array([5])] * 4 + [np.array([6])] * 4,
             resp, np.zeros(8))
    return h


def test_predictor_stats_and_unseen_median():
    h = _store()
    np.testing.assert_allclose(predict_lengths(h, [1, 2, 3], "mean"), [5.0, 12.5, 8.75])
    np.testing.assert_allclose(predict_lengths(h, [1, 2, 3], "max"), [8.0, 20.0, 14.0])
    # p90, linear interpolation: [2,4,6,8] -> 6 + 0.7*2; [10,10,10,20] -> 10 + 0.7*10
    np.testing.assert_allclose(predict_lengths(h, [3, 1, 2], "p90"), [12.2, 7.4, 17.0])
    # a mapping works as history too (the replay benchmark)
    np.testing.assert_allclose(predict_lengths({7: np.array([3, 5])}, [7, 8]), [4.0, 4.0])


def test_predictor_cold_start_and_errors():
    h = _store()
    np.testing.assert_allclose(predict_lengths(h, [9, 10], default=32.0), [32.0, 32.0])
    with pytest.raises(ValueError, match="default="):
        predict_lengths(h, [9, 10])
    with pytest.raises(ValueError, match="sched.length_stat"):
        predict_lengths(h, [1], "median")


# ----------------------------------------------------------------------------- cost model
def test_cost_model_formula_and_decode_cost():
    cm = CostModel(a=1.0, b=10.0, c=100.0)
    assert cm(5, 3) == 5 * (1 + 30) + 300
    np.testing.assert_allclose(cm.seconds(np.array([5, 5]), np.array([3, 0])), [455.0, 0.0])
    # decode step by step: live rows per step for lengths [1, 3] are 2, 1, 1
    assert cm.decode_cost([1, 3]) == (1 + 20) + (1 + 10) + (1 + 10) + 200
    assert cm.decode_cost([]) == 0.0


def test_cost_model_fit_recovers_coefficients():
    rng = np.random.default_rng(0)
    true = CostModel(a=2e-3, b=3e-5, c=5e-4)
    tokens = rng.integers(16, 512, 40).astype(float)
    batch = rng.integers(1, 64, 40).astype(float)
    exact = np.stack([tokens, batch, true.seconds(tokens, batch)], 1)
    fit = CostModel.fit(exact)
    np.testing.assert_allclose([fit.a, fit.b, fit.c], [true.a, true.b, true.c], rtol=1e-6)
    noisy = exact.copy()
    noisy[:, 2] *= 1 + 0.01 * rng.standard_normal(40)
    fit = CostModel.fit(noisy)
    np.testing.assert_allclose([fit.a, fit.b], [true.a, true.b], rtol=0.05)
    with pytest.raises(CostModelError, match="identifiable"):
        CostModel.fit([[10, 4, 1.0], [20, 4, 2.0], [30, 4, 3.0]])  # batch never varies
    with pytest.raises(CostModelError, match="samples"):
        CostModel.fit([[10, 4, 1.0]])


def test_cost_model_from_pass_cost_recovers_a_b_c_of_a_synthetic_profile():
    from rhyme_jax.rollout import shapes
    from rhyme_jax.rollout.pass_cost import PassCost

    a, b, c, prompt = 2e-3, 3e-5, 4e-4, 80  # c: 80 prompt tokens at g = 5e-6 s per packed token
    g = c / prompt
    plan = shapes.plan(max_slots=64, page_size=16, max_prompt_len=128, max_new_tokens=96)
    programs = [p for p in plan.programs(spec=True) if p.kind != "prefill"]
    assert {p.rows for p in programs} == {4, 16, 64} and any(p.tokens > p.rows for p in programs)
    profile = PassCost({(p.rows, p.tokens, p.q_len): a + b * p.rows + g * (p.tokens - p.rows) for p in programs})
    fit = CostModel.from_pass_cost(profile, prompt)
    np.testing.assert_allclose([fit.a, fit.b, fit.c], [a, b, c], rtol=1e-6)
    # a decode pass of S rows costs a + b S: the model's seconds for one token of a batch of S, less c S
    np.testing.assert_allclose(fit.seconds(1, 16) - fit.c * 16, profile(16, 16, 1), rtol=1e-6)
    assert CostModel.from_pass_cost(profile, 0).c == 0.0
    with pytest.raises(CostModelError, match="no profiled programs"):
        CostModel.from_pass_cost(PassCost.prior(), prompt)
    decode_only = PassCost({k: v for k, v in profile.seconds.items() if k[2] == 1})
    with pytest.raises(CostModelError, match="identifiable"):
        CostModel.from_pass_cost(decode_only, prompt)
    with pytest.raises(CostModelError, match="prompt_tokens"):
        CostModel.from_pass_cost(profile, -1)


def test_cost_model_save_load_and_errors(tmp_path):
    path = CostModel(a=1e-3, b=2e-5, c=3e-4).save(tmp_path / "cm.json", meta={"device": "cpu"})
    assert CostModel.load(path) == CostModel(a=1e-3, b=2e-5, c=3e-4)
    assert json.loads(path.read_text())["meta"] == {"device": "cpu"}
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1e-3, "b": ')
    with pytest.raises(CostModelError, match="bad.json"):
        CostModel.load(bad)
    bad.write_text('{"a": 1e-3, "c": 1e-3}')
    with pytest.raises(CostModelError, match=r"bad.json.*missing field 'b'"):
        CostModel.load(bad)
    bad.write_text('{"a": 1e-3, "b": -1, "c": 1e-3}')
    with pytest.raises(CostModelError, match=r"bad.json.*field 'b'"):
        CostModel.load(bad)
    with pytest.raises(CostModelError, match="nope.json"):
        CostModel.load(tmp_path / "nope.json")


# ----------------------------------------------------------------------------- planner
def test_ranking_groups_sorted_stable():
    pred = np.array([30.0, 10.0, 20.0, 10.0, 50.0])
    groups = ranking_groups(pred, 2)
    assert [g.tolist() for g in groups] == [[1, 3, 2], [0, 4]]
    assert len(ranking_groups(pred, 9)) == 5  # capped at P


def test_odd_even_order():
    pred = np.array([40.0, 10.0, 30.0, 20.0])  # ranking: group 0 = prompts {1, 3}, group 1 = {0, 2}
    odd = plan_step(1, pred, 2, 2, COST, tier2=False, num_groups=2)
    even = plan_step(2, pred, 2, 2, COST, tier2=False, num_groups=2)
    assert odd.ascending and odd.order == [0, 1] and odd.worker_group == [0, 1]
    assert [r.tolist() for r in odd.worker_rows] == [[2, 3, 6, 7], [0, 1, 4, 5]]
    assert not even.ascending and even.order == [1, 0] and even.worker_group == [1, 0]
    assert [r.tolist() for r in even.worker_rows] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    model_cost = odd.predicted_seconds[1]  # the cost model's T(longest 40, 4 rows), not a timing
    assert model_cost == pytest.approx(COST(40, 4))


def test_fifo_equals_process_groups():
    from rhyme_jax.parallel.distributed import process_groups

    pred = np.random.default_rng(1).uniform(5, 60, 14)
    for W in (1, 3, 4, 5):
        plan = plan_step(2, pred, 8, W, COST, mode="fifo")
        for w, prompts in enumerate(process_groups(14, W)):
            assert plan.worker_rows[w].tolist() == [r for p in prompts for r in range(p * 8, p * 8 + 8)]
        # tier switches both off with one group per worker is fifo as well
        off = plan_step(2, pred, 8, W, COST, tier1=False, tier2=False, num_groups=W)
        assert [r.tolist() for r in off.worker_rows] == [r.tolist() for r in plan.worker_rows]


@pytest.mark.parametrize("tier1,tier2", list(itertools.product([True, False], repeat=2)))
@pytest.mark.parametrize("W,G", [(4, 0), (4, 1), (8, 3), (3, 5), (6, 2)])
def test_group_integrity_every_row_once(tier1, tier2, W, G):
    rng = np.random.default_rng(W * 10 + G)
    P, n = 16, 8
    pred = rng.uniform(5, 60, P)
    for step in (1, 2):
        plan = plan_step(step, pred, n, W, COST, tier1=tier1, tier2=tier2, num_groups=G)
        check_plan(plan, P)  # every row once; prompts whole
        assert len(plan.worker_rows) == W
        for rows in plan.worker_rows:  # a prompt's rows form one contiguous run within its worker
            p = rows // n
            runs = 1 + int(np.count_nonzero(p[1:] != p[:-1])) if p.size else 0
            assert runs == np.unique(p).size
        if tier1 and not tier2 and G and G <= W:  # even spread over groups, counts differ by <= n
            for g, gp in enumerate(plan.groups):
                counts = [rows.size for rows, gs in zip(plan.worker_rows, plan.worker_groups) if gs == (g,)]
                assert len(counts) == plan.group_workers[g] and max(counts) - min(counts) <= n


def test_sample_level_split_when_group_has_fewer_prompts_than_workers():
    pred = np.array([60.0, 10.0])
    plan = plan_step(1, pred, 8, 6, CostModel(a=0.0, b=1.0, c=0.0), num_groups=2)
    check_plan(plan, 2)
    # T = tokens * batch. Group 1 (prompt 0: 8 rows, length 60) needs 4 workers for the optimal
    # makespan 60 * 2 = 120 (a 5th would not lower it); the spare worker halves group 0's batch.
    # Both groups have one prompt, so their rows are split at sample level.
    assert plan.group_workers.tolist() == [2, 4]
    assert rows_per_worker(plan).tolist() == [4, 4, 2, 2, 2, 2]
    assert plan.predicted_makespan == 120.0
    assert max_worker_rows(1, 8, 5) == 2 and max_worker_rows(5, 8, 2) == 24


def test_tier2_hand_case():
    # T = tokens * batch: group 0 has 1 prompt, group 1 six prompts, equal lengths; W = 4
    k = allocate_workers(np.array([1, 6]), np.array([10.0, 10.0]), 4, CostModel(a=0.0, b=1.0, c=0.0), 1)
    assert k.tolist() == [1, 3]  # makespan max(10*1, 10*2) = 20
    with pytest.raises(ValueError, match="tier 2 needs G <= W"):
        allocate_workers(np.array([1, 1, 1]), np.array([1.0, 1, 1]), 2, COST, 1)


def _brute_force(prompts, lens, W, cost, n):
    best = np.inf
    ranges = [range(1, min(W, p * n) + 1) for p in prompts]
    for ks in itertools.product(*ranges):
        if sum(ks) <= W:
            best = min(best, max(cost.seconds(l, max_worker_rows(p, n, k)) for p, l, k in zip(prompts, lens, ks)))
    return best


def test_tier2_allocation_optimal_vs_brute_force():
    rng = np.random.default_rng(3)
    cases = 0
    for _ in range(150):
        W = int(rng.integers(1, 7))
        G = int(rng.integers(1, min(W, 3) + 1))
        n = int(rng.choice([1, 2, 4]))
        prompts = rng.integers(1, 5, G)
        lens = rng.uniform(1, 100, G)
        cost = CostModel(*rng.uniform(0, 1, 3) * [1e-3, 1e-4, 1e-3])
        k = allocate_workers(prompts, lens, W, cost, n)
        assert k.min() >= 1 and k.sum() <= W and np.all(k <= prompts * n)
        got = max(cost.seconds(l, max_worker_rows(p, n, kk)) for p, l, kk in zip(prompts, lens, k))
        assert got == pytest.approx(_brute_force(prompts, lens, W, cost, n), rel=1e-12)
        cases += 1
    assert cases == 150


def test_more_groups_than_workers_lpt():
    # 4 single-prompt groups, W = 2, T = tokens * batch: costs 10, 20, 30, 40 -> LPT {40, 10}, {30, 20}
    pred = np.array([10.0, 20.0, 30.0, 40.0])
    plan = plan_step(1, pred, 1, 2, CostModel(a=0.0, b=1.0, c=0.0), num_groups=4)
    check_plan(plan, 4)
    assert sorted(map(sorted, plan.worker_groups)) == [[0, 3], [1, 2]]
    assert plan.notes and "longest-processing-time" in plan.notes[0]
    even = plan_step(1, pred, 1, 2, COST, num_groups=4, tier2=False)  # contiguous in tier-1 order
    assert even.worker_groups == [(0, 1), (2, 3)]


def test_plan_step_errors():
    with pytest.raises(ValueError, match="sched.mode"):
        plan_step(1, np.ones(4), 2, 2, COST, mode="lifo")
    with pytest.raises(ValueError, match="pred"):
        plan_step(1, np.array([1.0, np.nan]), 2, 2, COST)


# ----------------------------------------------------------------------------- timeline
def test_bubble_metrics_hand_timeline():
    ivs = [WorkerInterval(0, 0, 10), WorkerInterval(1, 0, 4), WorkerInterval(1, 3, 5),
           WorkerInterval(1, 6, 8, "migrated"), WorkerInterval(2, 2, 5)]
    m = bubble_metrics(ivs, 3)
    assert m["makespan_s"] == 10
    assert m["busy_s"] == [10, 7, 3]  # worker 1: [0,5] merged + [6,8]
    assert m["bubble_fraction"] == pytest.approx(1 - 20 / 30)
    assert m["earliest_finisher"] == 2 and m["earliest_finisher_idle"] == pytest.approx(0.5)
    m4 = bubble_metrics(ivs, 4)  # worker 3 never works: idle the whole window
    assert m4["bubble_fraction"] == pytest.approx(1 - 20 / 40)
    assert m4["earliest_finisher"] == 3 and m4["earliest_finisher_idle"] == 1.0
    with pytest.raises(ValueError):
        WorkerInterval(0, 5, 4)


def test_gantt_png_written(tmp_path):
    steps = {s: [WorkerInterval(w, 0.0, 1.0 + 0.1 * w * s) for w in range(4)] for s in range(1, 41)}
    assert select_steps(list(steps), 8) == [1, 2, 3, 4, 37, 38, 39, 40]
    out = plot_gantt(steps, tmp_path / "g" / "gantt.png", num_workers=4)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in out.parent.iterdir() if p.name != "gantt.png"]  # no temp files left


# ----------------------------------------------------------------------------- replay (benchmarks.schedule)
def test_replay_simulation_with_migration():
    bench = replay_bench
    pred = np.array([2.0, 2.0])
    plan = plan_step(1, pred, 10, 2, COST, mode="fifo")
    lengths = np.array([2] * 9 + [10] + [2] * 10)
    cost = CostModel(a=1.0, b=0.0, c=0.0)
    ivs, moved = bench.simulate(plan, lengths, np.repeat(pred, 10), cost, migrate=False)
    assert moved == 0 and [(iv.worker, iv.end) for iv in ivs] == [(0, 10.0), (1, 2.0)]
    # worker 0: after step 2 one row runs (<= 10%); at step 4 it exceeds 1.5 x 2 and moves to idle worker 1
    ivs, moved = bench.simulate(plan, lengths, np.repeat(pred, 10), cost, migrate=True)
    assert moved == 1
    assert [(iv.worker, iv.start, iv.end, iv.kind) for iv in ivs] == [
        (0, 0.0, 4.0, "rollout"), (1, 0.0, 2.0, "rollout"), (1, 4.0, 10.0, "migrated")]
    # one-step-off chaining: worker 1 starts step 2 at 2 s; training (1 s) of step 1 gates step 3
    pipe = bench.one_step_off(np.array([[4.0, 2.0], [4.0, 2.0], [1.0, 1.0]]), 1.0)
    assert pipe["span_s"] == 9.0 and pipe["bubble_fraction"] == pytest.approx(1 - 14 / 18)


def test_replay_synthetic_runs():
    bench = replay_bench
    steps, max_new = bench.synthetic_steps(seed=0, num_prompts=32, prompts_per_step=8, n=4, steps=12)
    res = bench.replay(steps, num_workers=4, max_new_tokens=max_new)
    assert res["replayed_steps"] == 8 and res["cold_steps_skipped"] == 4 and res["rows"] == 8 * 32
    for a in res["configs"].values():
        assert 0.0 <= a["bubble_fraction"] < 1.0 and 0.0 <= a["migrated_share"] <= 1.0
    assert res["configs"]["fifo"]["migrated_share"] == 0.0


def test_long_tail_row_is_migrated_and_bounds_the_makespan():
    """A long-tailed step (the ledger task's shape: prompts predicted at 80..3,200 tokens, one
    sample running on to 4,000): with migration the long row is stopped once it is 1.5x past its
    prediction and among its worker's last 10% and continued on an idle worker; no placement
    finishes before that row's own serial decode (``a`` per token at batch 1): the bound
    HistoPipe's sync placement cannot beat."""
    bench = replay_bench
    pred, n = np.array([80.0, 82, 90, 100, 120, 380, 900, 3200]), 8
    cost = CostModel(a=1e-3, b=2e-5, c=1e-3)
    lengths = np.repeat(pred, n).astype(np.int64)
    lengths[5 * n] = 4000
    bound = 4000 * (cost.a + cost.b)
    for mode in ("fifo", "histopipe"):
        plan = plan_step(1, pred, n, 4, cost, mode=mode)
        check_plan(plan, 8)
        still, moved0 = bench.simulate(plan, lengths, np.repeat(pred, n), cost, migrate=False)
        ivs, moved = bench.simulate(plan, lengths, np.repeat(pred, n), cost, migrate=True)
        assert moved0 == 0 and moved == 1
        mig = [iv for iv in ivs if iv.kind == "migrated"]
        src = next(iv for iv in ivs if iv.kind == "rollout" and iv.end == mig[0].start)
        assert len(mig) == 1 and mig[0].worker != src.worker
        for run in (still, ivs):
            assert max(iv.end for iv in run) >= bound


def test_spread_placement_deals_every_prompt_over_the_workers():
    """``sched.placement: spread`` (``plan_step(spread=True)``): prompts by descending predicted
    length, their rows dealt round-robin over the workers where the last prompt stopped (the
    count matrix below, by hand); each worker's samples of a prompt are one contiguous run of its
    rows, in worker order; every row once. Where one prompt's long samples would stack on one
    worker, fifo's makespan is ``a 100 + b 210`` and the spread's ``a 100 + b 115`` (the replay's
    simulation, cost model ``a = 10 b``). The config key is checked at load time."""
    from rhyme_jax.sched.spread_placement import spread_counts

    pred, n, W = np.array([50.0, 900.0, 10.0, 300.0, 20.0]), 6, 4
    want = np.array([[2, 2, 2, 1, 1], [2, 2, 2, 1, 1], [1, 1, 1, 2, 2], [1, 1, 1, 2, 2]])
    np.testing.assert_array_equal(spread_counts(pred, n, W), want)
    plan = plan_step(3, pred, n, W, COST, spread=True)
    check_plan(plan, pred.size)
    assert plan.notes == ["spread placement"] and plan.group_workers.tolist() == [4] * 5
    assert rows_per_worker(plan).tolist() == [8, 8, 7, 7]
    start = np.zeros(pred.size, np.int64)
    for w, rows in enumerate(plan.worker_rows):
        for p in range(pred.size):
            mine = rows[rows // n == p]
            np.testing.assert_array_equal(mine, p * n + start[p] + np.arange(want[w, p]))
            start[p] += want[w, p]
    assert sorted(plan.worker_groups[2]) == [0, 1, 2, 3, 4]

    cost = CostModel(a=10e-3, b=1e-3, c=0.0)
    lengths, prior = np.array([100, 5, 100, 5, 5, 5, 5, 5]), np.array([100.0, 5.0])
    spans = {}
    for name, kw in {"fifo": {"mode": "fifo"}, "spread": {"spread": True}}.items():
        ivs, _ = replay_bench.simulate(plan_step(1, prior, 4, 2, cost, **kw), lengths, np.repeat(prior, 4), cost,
                                       migrate=False)
        spans[name] = max(iv.end for iv in ivs)
    assert spans["fifo"] == pytest.approx(10e-3 * 100 + 1e-3 * 210)
    assert spans["spread"] == pytest.approx(10e-3 * 100 + 1e-3 * 115)
    from rhyme_jax.config import load_config

    assert load_config(ROOT / "configs/default.yaml", ["sched.placement=spread"]).sched.placement == "spread"


def test_exact_placement_is_the_best_whole_prompt_plan():
    """``sched.placement: exact`` (``plan_step(exact=True)``): against brute force over every
    assignment of 6 prompts to 3 workers, its plan has the least predicted makespan under the cost
    model's ``decode_cost`` (every sample at its prompt's predicted length); every row once, a
    prompt's rows on one worker; never above the tiers' plan; beyond ``MAX_PROMPTS`` prompts the
    tiers plan, with a note; the config key is checked at load time."""
    from rhyme_jax.sched.exact_placement import MAX_PROMPTS

    cost = CostModel(a=5e-3, b=5e-4, c=1e-3)  # a pass costs 10 rows: the CPU's regime
    pred, n, W = np.array([900.0, 40.0, 300.0, 95.0, 20.0, 210.0]), 4, 3
    plan = plan_step(2, pred, n, W, cost, exact=True)
    check_plan(plan, pred.size)
    assert plan.notes == ["exact placement"]

    def makespan(worker_prompts):
        return max(cost.decode_cost(np.repeat(pred[list(ps)], n)) if ps else 0.0 for ps in worker_prompts)

    got = makespan([np.unique(r // n).tolist() for r in plan.worker_rows])
    brute = min(makespan([[p for p in range(6) if a[p] == w] for w in range(W)])
                for a in itertools.product(range(W), repeat=6))
    assert got == pytest.approx(brute)
    tiers = plan_step(2, pred, n, W, cost)
    assert got <= makespan([np.unique(r // n).tolist() for r in tiers.worker_rows]) + 1e-12
    many = plan_step(1, np.arange(1.0, MAX_PROMPTS + 2), 2, 4, cost, exact=True)
    check_plan(many, MAX_PROMPTS + 1)
    assert any("tiers used" in note for note in many.notes)
    from rhyme_jax.config import load_config
    from rhyme_jax.config.checks import ConfigError

    assert load_config(ROOT / "configs/default.yaml", ["sched.placement=exact"]).sched.placement == "exact"
    with pytest.raises(ConfigError, match="placement"):
        load_config(ROOT / "configs/default.yaml", ["sched.placement=dp"])
