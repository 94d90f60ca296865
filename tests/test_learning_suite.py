"""Suite ``learning`` at the tiny scale (``python -m rhyme_lab ablate learning``): the three L1 runs
(HistoSpec off, AIMD, goodput; same seed) sample the same tokens and rewards, the per-epoch
table and the oracle bound are computed from them, and L3 reports the lagged pipelines beside the
sync run. The oracle's batch pricing is checked on constructed rows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rhyme_lab.ablate import learning, measures, oracle, registry
from rhyme_jax.rollout.pass_cost import PassCost



def _tiny_suite(out, only: str, sets: tuple[str, ...] = ()):
    """The units of ``only`` once at the tiny scale in this process (``sets`` on the GRPO units),
    then the suite's report."""
    from rhyme_lab.ablate import runner
    from rhyme_lab.ablate.units import run_unit

    for name in registry.units_of(only.split(",")):
        run_unit(name, out, "tiny", sets if name != "demo_sft" else ())
    return runner.run_suite("learning", scale="tiny", out=out, only=only, progress=False)


@pytest.fixture(scope="module")
def tiny_learning(tmp_path_factory, compile_cache):
    out = tmp_path_factory.mktemp("learning")
    table, results = _tiny_suite(out, "L1")
    return out, table, results


def test_units_of_the_learning_ids():
    assert registry.units_of(["L1"]) == ["demo_sft", "learn_plain", "learn_aimd", "learn_goodput",
                                         "learn_goodput_paired", "learn_oracle_paired"]
    assert registry.units_of(["L2"]) == ["learn_real_plain", "learn_real_aimd", "learn_real_goodput",
                                         "learn_real_goodput_paired", "learn_real_oracle_paired"]
    assert registry.UNITS["learn_oracle_paired"].oracle == registry.UNITS["learn_real_oracle_paired"].oracle == \
        "sources"
    assert registry.units_of(["L3"]) == ["demo_sft", "learn_plain", "learn_one_step_off", "learn_cross_step"]


@pytest.mark.slow  # CI time (45 s: four tiny learning units); the other tests here cover the suite's tables
def test_histospec_runs_are_one_workload(tiny_learning):
    out, table, results = tiny_learning
    l1 = results["L1"]
    assert l1["status"] == "ok", l1.get("reason")
    assert l1["identity_ok"], l1["ours"]
    plain = out / "runs" / "learn_plain"
    for name in ("learn_aimd", "learn_goodput"):
        same = learning.identity(plain, out / "runs" / name)
        assert same["steps"] == 3 and same["identical"] == 3 and same["tokens"] > 0, same
    # every step is an epoch at this scale (2 prompts, 2 per step): drafts from epoch 2 on
    aimd, goodput = l1["epochs"]["learn_aimd"], l1["epochs"]["learn_goodput"]
    assert [r["epoch"] for r in goodput] == [r["epoch"] for r in aimd] == [1, 2, 3]
    # the paper's drafter has no source in epoch 1 (no history, no self-lookup); goodput has
    assert aimd[0]["acceptance"] is None and aimd[1]["acceptance"] is not None
    assert goodput[0]["acceptance"] is not None
    for rows in (aimd, goodput):
        assert all(r["entropy"] is not None and r["entropy"] > 0 for r in rows)
        assert all(r["bound"] is not None and r["bound"] >= 1.0 for r in rows)
        assert all(r["bound_history_self"] is not None and r["bound_history_self"] >= 1.0 for r in rows)
        assert all(r["passes"] <= r["plain_passes"] for r in rows)
        assert all(r["h200_projection"] is not None and r["h200_projection"] > 0 for r in rows)
    # goodput's paired unit: each step's rollout decoded plain and with HistoSpec back to back
    assert all(r["paired_rollout"] > 0 and r["paired_e2e"] > 0 for r in goodput)
    assert all("paired_rollout" not in r for r in aimd)
    assert learning.identity(plain, out / "runs" / "learn_goodput_paired")["identical"] == 3
    # the live bound: the source-bound oracle drafter through the same engine, paired with plain,
    # on the same workload; the targets judge goodput against it
    assert learning.identity(plain, out / "runs" / "learn_oracle_paired")["identical"] == 3
    assert all(r["oracle_rollout"] > 0 for r in goodput) and all("oracle_rollout" not in r for r in aimd)
    assert learning.judged_bound(goodput[-1]) == (goodput[-1]["oracle_rollout"], "the live oracle drafter (paired)")
    # the oracle unit also decodes each step with the run's own drafter, between plain and oracle
    oracle_steps = json.loads((out / "units" / "learn_oracle_paired.json").read_text())["result"]["steps"]
    assert all(s["own"]["generated_tokens"] == s["plain"]["generated_tokens"] == s["spec"]["generated_tokens"] > 0
               for s in oracle_steps)
    assert all(r["of_bound_same_steps"] > 0 for r in goodput) and "| of the bound, same steps |" in table.read_text()
    text = table.read_text()
    assert "## L1" in text and "| epoch | steps | entropy" in text
    assert (out / "learning_L1.png").is_file()


@pytest.mark.slow  # CI time (26 s: three tiny runs); test_histopipe_beside_fifo_on_four_workers keeps a paired table
def test_lagged_pipelines_beside_sync(tmp_path, compile_cache):
    _, results = _tiny_suite(tmp_path, "L3")
    l3 = results["L3"]
    assert l3["status"] == "ok", l3.get("reason")
    variants = {f["variant"] for f in l3["figures"]}
    assert {"sync", "one_step_off", "cross_step", "one_step_off / sync", "cross_step / sync"} <= variants


def test_oracle_prices_batch_passes_with_the_pass_cost():
    cost = PassCost({(2, 2, 1): 1.0, (2, 4, 2): 1.5, (1, 1, 1): 0.6, (1, 3, 3): 0.9}, {})
    # plain: 3 passes of 2 rows, then 1 of 1 row
    assert oracle.batch_cost([[0, 0, 0, 0], [0, 0, 0]], cost) == pytest.approx(3 * 1.0 + 0.6)
    # oracle: pass 0 packs 2 + 2 tokens (q 2), pass 1 one row of 3 tokens (q 3)
    assert oracle.batch_cost([[1, 2], [1]], cost) == pytest.approx(1.5 + 0.9)


def test_step_bound_takes_the_fastest_window_and_never_loses_to_plain():
    prompt = np.array([1, 2], np.int32)
    response = np.array([5, 6, 7, 8, 9], np.int32)
    cost = PassCost.prior()  # 2 * rows + tokens
    # the history holds the whole response: after the prefill's token one pass of 4 accepted
    plain, best = oracle.step_bound([prompt], [response], [[np.concatenate([prompt, response])]], cost, 64)
    assert plain == pytest.approx(4 * (2 + 1)) and best == pytest.approx(2 + 5)
    # nothing to draft from: the oracle falls back to plain decode's cost
    plain, best = oracle.step_bound([prompt], [response], [[]], cost, 64)
    assert best == pytest.approx(plain)


def test_gpu_projection_prices_passes_by_their_drafts():
    plain = [{"rollout/forward_passes": 10.0}]
    # half the passes, no drafts: twice as fast; 3 drafts per row per pass cost 1.21x a decode pass
    assert learning.gpu_projection(plain, [{"rollout/forward_passes": 5.0}], rows=4) == pytest.approx(2.0)
    spec = [{"rollout/forward_passes": 5.0, "spec/drafted_tokens": 5 * 4 * 3.0}]
    assert learning.gpu_projection(plain, spec, rows=4) == pytest.approx(2.0 / 1.21)
    assert learning.gpu_projection(plain, [], rows=4) is None


def test_histopipe_beside_fifo_on_four_workers(tmp_path, compile_cache):
    # the test process has one CPU device: the 4 workers' placement runs on one (the fake 4-device
    # mesh is what `python -m rhyme_lab ablate` gives the units: -m slow tests/test_ablate.py spawns one)
    _, results = _tiny_suite(tmp_path, "L4", ("parallel.rollout_workers=1",))
    l4 = results["L4"]
    assert l4["status"] == "ok", l4.get("reason")
    rows = l4["rows"]
    assert [r["epoch"] for r in rows] == [1, 2, 3] and registry.UNITS["learn_workers_fifo"].devices == 8
    for r in rows:
        assert r["makespan_base"] > 0 and r["makespan"] > 0 and 0.0 <= r["idle"] <= 1.0
        assert r["makespan_ratio"] == pytest.approx(r["makespan_base"] / r["makespan"])
    assert "makespan" in l4["ours"] and "| epoch | steps | makespan fifo" in l4["details"]
    # the paired run: every step also placed fifo by a twin, alternately before and after its own
    # rollout; the twin's output is discarded, so the run trains on what the HistoPipe run does
    unit = lambda n: json.loads((tmp_path / "units" / f"{n}.json").read_text())["result"]  # noqa: E731
    paired, alone = unit("learn_workers_paired"), unit("learn_workers_histopipe")
    assert paired["twin"] == "fifo"
    assert [s["twin"]["first"] for s in paired["steps"]] == [True, False, True]
    assert all(s["twin"]["time/rollout_makespan_s"] > 0 and s["twin"]["seconds"] > 0 for s in paired["steps"])
    assert [s["reward/mean"] for s in paired["steps"]] == [s["reward/mean"] for s in alone["steps"]]
    assert l4["ours"].startswith("paired (fifo twin in the same steps)")
    twin = learning.twin_rows(paired)
    assert sorted(twin) == [1, 2, 3] and all(t["makespan_ratio"] > 0 for t in twin.values())


def test_twin_placement_needs_synchronous_rollouts():
    from types import SimpleNamespace

    from rhyme_lab.ablate.paired_placement import TwinPlacement

    scheduler = SimpleNamespace(cfg=SimpleNamespace(pipeline="one_step_off"))
    with pytest.raises(ValueError, match="sched.pipeline=sync"):
        TwinPlacement("fifo", {}).wrap_submit(lambda *a, **kw: None, scheduler)


def test_oracle_cost_model_scales_unobserved_programs_like_the_engine():
    rows = {"profiled": [[4, 4, 1, 2.0], [4, 8, 3, 3.0], [8, 8, 1, 4.0]], "live": [[4, 4, 1, 1.0]], "meta": {}}
    cost, in_seconds = oracle.cost_model(rows)
    assert in_seconds and cost(4, 4, 1) == 1.0 and cost(4, 8, 3) == 1.5 and cost(8, 8, 1) == 4.0
    assert oracle.cost_model({})[1] is False


def test_source_bound_keeps_the_prompts_last_rollouts_as_history():
    """``SourceBound(depth)``: a prompt's history is its responses in its last ``depth`` rollouts
    (all of its samples in each), as the trainer's history store keeps them for the real drafter."""
    from rhyme_lab.measure.oracle_drafters import SourceBound

    p, q = [1, 2], [3]
    bound = SourceBound(depth=1)
    first = bound([p, p, q], [np.array([5, 6]), np.array([5, 7]), np.array([9])], 4)
    assert [len(h) for h in first.history] == [0, 0, 0]
    second = bound([p, p], [np.array([8]), np.array([8, 8])], 4)
    # prompt p's two responses of the first rollout, each with the prompt prepended
    assert [[h.tolist() for h in hs] for hs in second.history] == [[[1, 2, 5, 6], [1, 2, 5, 7]]] * 2
    third = bound([p, q], [np.array([4]), np.array([4])], 4)
    assert [[h.tolist() for h in hs] for hs in third.history] == [[[1, 2, 8], [1, 2, 8, 8]], [[3, 9]]]
    every = SourceBound()
    for resp in ([5], [6], [7]):
        last = every([p], [np.array(resp)], 4)
    assert [h.tolist() for h in last.history[0]] == [[1, 2, 5], [1, 2, 6]]


def test_paired_epochs_leave_the_oracles_search_time_out():
    """The live bound is the oracle drafter's rollout without its Python search over the sources
    (``host_drafting=False``); a real drafter's paired ratio keeps its host time."""
    step = {"step": 2, "rollout/epoch": 2, "wall_s": 10.0, "plain": {"seconds": 3.0},
            "spec": {"seconds": 2.0, "drafting_seconds": 0.5}}
    r = {"skip": 1, "steps": [{**step, "step": 1, "rollout/epoch": 1}, step]}
    real, bound = learning.paired_epochs(r), learning.paired_epochs(r, host_drafting=False)
    assert real[2]["rollout"] == pytest.approx(1.5) and bound[2]["rollout"] == pytest.approx(2.0)
    # the rest of the step (10 - 3 - 2 = 5 s) counts in both sides of the end-to-end ratio
    assert real[2]["e2e"] == pytest.approx((5 + 3) / (5 + 2)) and set(real) == {2}
    assert "of_bound" not in bound[2]
    # an oracle unit's own-drafter rollout in the same steps: its share of the bound, and the
    # rest of the step leaves all three rollouts out (10 - 3 - 2 - 2.5 = 2.5 s)
    own = {"skip": 1, "steps": [r["steps"][0], {**step, "own": {"seconds": 2.5}}]}
    triple = learning.paired_epochs(own, host_drafting=False)[2]
    assert triple["of_bound"] == pytest.approx(1.5 / 2.5) and triple["own_rollout"] == pytest.approx(3.0 / 2.5)
    assert triple["e2e"] == pytest.approx((2.5 + 3) / (2.5 + 1.5))
    assert triple["of_bound_se"] is None  # one step: no spread to estimate


def test_share_of_the_bound_carries_its_standard_error():
    # two steps whose shares are 0.5 and 1.0: ratio of sums 1.5 / 2 and the delta-method error
    steps = [{"step": k, "rollout/epoch": 2, "wall_s": 10.0, "plain": {"seconds": 3.0},
              "spec": {"seconds": sp, "drafting_seconds": 0.0}, "own": {"seconds": 1.0}}
             for k, sp in ((2, 0.5), (3, 1.0))]
    ep = learning.paired_epochs({"skip": 1, "steps": steps}, host_drafting=False)[2]
    assert ep["of_bound"] == pytest.approx(0.75)
    # d = (0.5 - 0.75, 1.0 - 0.75): sqrt(0.125 / 2) / 1
    assert ep["of_bound_se"] == pytest.approx(0.25)
    r, se = measures.ratio_of_sums([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert (r, se) == (pytest.approx(2.0), pytest.approx(0.0))  # proportional samples: no error
    with pytest.raises(ValueError, match="num/den"):
        measures.ratio_of_sums([1.0], [1.0, 2.0])
    row = {"epoch": 3, "entropy": 0.1, "rollout_ratio": 1.6, "e2e_ratio": 1.1, "paired_rollout": 1.6,
           "paired_e2e": 1.1, "oracle_rollout": 2.0, "bound": 2.0, "of_bound_same_steps": 0.82,
           "of_bound_same_steps_se": 0.031}
    assert learning.targets([row]) == ["epoch 3: 82% ± 3% of the live oracle drafter (paired) 2.00x in the same steps"]
    assert "| 82% ± 3% |" in "\n".join(learning.table_lines("L1", [{**row, "steps": 10, "reward": 0.5,
                                                                        "acceptance": 0.9, "tokens_per_forward": 5.0,
                                                                        "passes": 20, "plain_passes": 44,
                                                                        "h200_projection": None}]))


def test_pooled_units_give_ratios_with_their_errors(tmp_path):
    """``ablate.pool`` (``python -m benchmarks.paired_pool``): repeats of a paired unit pooled step
    by step, for oracle units (goodput's share of the bound) and plain paired units."""
    from rhyme_lab.ablate import pool

    def unit(path, own_s=None, spec_s=1.2):
        steps = [{"step": k, "rollout/epoch": 1 + (k > 2), "wall_s": 10.0, "plain": {"seconds": 3.0},
                  "spec": {"seconds": spec_s, "drafting_seconds": 0.2}} for k in (1, 2, 3, 4)]
        for s in steps:
            if own_s is not None:
                s["own"] = {"seconds": own_s}
        path.write_text(json.dumps({"commit": "abc1234", "result": {"skip": 1, "steps": steps}}))
        return pool.load_unit(path, "any")

    a, b = unit(tmp_path / "a.json", 1.25), unit(tmp_path / "b.json", 2.0)
    # epoch 2 (steps 3, 4 of both): oracle 1.0 s (search time out) against 1.25 and 2.0 s; goodput
    # 12 / 6.5 s of rollout, and end to end with the rest of each step (10 - 3 - 1.2 - own s) on
    # both sides: (7.55 + 6.8) x 2 / (5.8 x 4)
    assert "| 2 | 4 | 80%, 50% | 61.5% ± 8.2% | 1.85 ± 0.25 | 3.00 | 1.24 ± 0.04 |" in pool.table_lines([a, b])
    assert pool.pooled([a, b])[1][2]["own_e2e"] == pytest.approx(28.7 / 23.2)
    # where the passes go: steps 3, 4 of both units, 10 passes per rollout, 4 drafted and 2
    # accepted per goodput rollout; ms per pass 3 s / 10, the oracle's search (0.2 s) left out
    for u in (a, b):
        for s in u["steps"]:
            for n in ("plain", "own", "spec"):
                s[n].update(forward_passes=10.0, drafted_tokens=4.0, accepted_tokens=2.0)
            s["own"]["drafting_seconds"] = 0.1
    rows = pool.pass_lines([a, b])
    assert rows[3] == "| 2 | 40 / 40 / 40 | 300.00 / 162.50 / 100.00 | 0.50 | 6.2% |"
    # plain paired units: rollout 3 / 1.2 and 3 / 1.5 s per step, pooled 12 / 5.4 with its error
    c, d = unit(tmp_path / "c.json"), unit(tmp_path / "d.json", spec_s=1.5)
    lines = pool.table_lines([c, d])
    assert lines[0] == "2 units (commits abc1234, abc1234)" and "| 2 | 4 | 2.50, 2.00 | 2.22 ± 0.14 |" in lines[4]
    with pytest.raises(ValueError, match="cannot be pooled together"):
        pool.pooled([a, c])
    (tmp_path / "units").mkdir()
    unpaired = {"result": {"skip": 1, "steps": [{"step": 2, "plain": {"seconds": 1.0}}]}}
    (tmp_path / "units" / "learn_oracle_paired.json").write_text(json.dumps(unpaired))
    with pytest.raises(ValueError, match="not a paired unit"):
        pool.load_unit(tmp_path, "learn_oracle_paired")


def test_paired_rollouts_take_turns_going_first():
    """``paired.PairedRollouts``: the compared rollouts of a call alternate their places (a
    machine can favour a place in a back-to-back sequence); with an oracle a first plain rollout
    gives it its tokens and the three compared rollouts rotate after it; the trainer always gets
    the HistoSpec (or oracle) rollout."""
    from types import SimpleNamespace

    from rhyme_lab.ablate.paired import PairedRollouts

    def fake_generate(order):
        def generate(state, prompts, sampling, key, drafter=None, **kw):
            who = "plain" if drafter is None else getattr(drafter, "name", "oracle")
            order.append(who)
            return SimpleNamespace(stats={"seconds": 1.0}, tokens=[np.array([7, 8])], who=who)
        return generate

    sp = SimpleNamespace(max_new_tokens=4)
    own = SimpleNamespace(name="own")
    for oracle, calls in (("", [["plain", "own"], ["own", "plain"], ["plain", "own"]]),
                          ("sources", [["plain", "plain", "own", "oracle"], ["plain", "own", "oracle", "plain"],
                                       ["plain", "oracle", "plain", "own"]])):
        rows, order = [], []
        gen = PairedRollouts(rows, oracle=oracle).wrap_generate(fake_generate(order))
        got = []
        for _ in calls:
            order.clear()
            got.append(gen(None, [[1, 2]], sp, None, drafter=own).who)
            assert order == calls[len(got) - 1]
        assert got == ["oracle" if oracle else "own"] * len(calls)
        assert all(set(r) == ({"first", "plain", "own", "spec"} if oracle else {"plain", "spec"}) for r in rows)
