"""``python -m rhyme_lab ablate``: the ablation configs load, every id runs one tiny step, the report holds
every id, finished work is not redone, and nothing in the package imports the runner."""

from __future__ import annotations

import ast
import csv
import json
from pathlib import Path

import pytest

from rhyme_lab.ablate import registry
from rhyme_lab.ablate.registry import ABLATIONS, SUITES, UNITS
from rhyme_jax.config import load_config

ROOT = Path(__file__).resolve().parents[1]
PAPER_IDS = ["A1", "A2", "A3", "A4", "A5", "A6", "A10", "K1", "K2", "K3", "K4", "K6", "O5", "O6"]
ONE_DEVICE = ("parallel.rollout_workers=1",)  # the test process has one CPU device


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "ablations").rglob("*.yaml")),
                         ids=lambda p: str(p.relative_to(ROOT / "configs" / "ablations")))
def test_every_ablation_config_loads(path):
    cfg = load_config(path)
    assert cfg.run.name.startswith("abl_")


def test_registry_covers_the_paper_ids_with_loadable_sweeps():
    assert list(SUITES["paper"]) == PAPER_IDS and list(SUITES["learning"]) == ["L1", "L2", "L3", "L4"]
    assert list(SUITES["longtail"]) == ["L5"] and list(SUITES["longtail_recur"]) == ["L6"]
    assert list(SUITES["longtail_recur_seed1"]) == ["L7"]
    assert list(ABLATIONS) == PAPER_IDS + list(SUITES["learning"]) + ["L5", "L6", "L7"]
    for a in ABLATIONS.values():
        assert a.units and all(u in UNITS for u in a.units), a.id
        for path in a.configs():
            assert (ROOT / path).is_file(), path
        if a.sweep and a.sweep[1]:
            key, values = a.sweep
            for v in values:
                if v == "goodput":  # a valid value; the drafter of this build may not draft with it
                    continue
                cfg = load_config(ROOT / a.configs()[0], [f"{key}={v}"])
                section, name = key.split(".")
                assert getattr(getattr(cfg, section), name) == v
    assert registry.units_of(["A1"]) == ["demo_sft", "e2e_fifo", "e2e_tier1_migration"]
    assert registry.suite_ids("paper", "k2,a1") == ["A1", "K2"]
    with pytest.raises(registry.AblationError, match="not in suite"):
        registry.suite_ids("histopipe", "K2")


def test_scales_place_every_unit_on_an_existing_config():
    for scale in registry.SCALES.values():
        for unit in UNITS.values():
            path, sets = registry.unit_config(unit, scale)
            cfg = load_config(ROOT / path, list(sets))
            assert cfg.run.name.startswith("abl_"), (scale.name, unit.name)
            if scale.name == "gpu" and unit.kind not in registry.LEARN_KINDS and unit.name not in registry.LEARN_WARM_STARTS:
                assert path.startswith("configs/ablations/gpu/") and cfg.data.source == "gsm8k"
    assert registry.unit_config(UNITS["real_session"], registry.SCALES["tiny"])[0].endswith("histospec_tiny.yaml")


def test_user_overrides_reach_the_runs_they_name():
    from rhyme_lab.ablate.units import sets_for

    sets = ["model.path=/ckpt/m", "session:rollout.max_slots=8", "e2e_fifo:grpo.steps=3", "e2e:spec.branch=count"]
    assert sets_for(UNITS["real_session"], sets) == ["model.path=/ckpt/m", "rollout.max_slots=8"]
    assert sets_for(UNITS["e2e_fifo"], sets) == ["model.path=/ckpt/m", "grpo.steps=3", "spec.branch=count"]
    assert sets_for(UNITS["e2e_histospec"], sets) == ["model.path=/ckpt/m", "spec.branch=count"]
    assert sets_for(UNITS["demo_sft"], ["data.train_path=C:/x:y"]) == ["data.train_path=C:/x:y"]


def test_list_prints_every_id_with_its_config(capsys):
    from rhyme_lab.cli.main import main

    assert main(["ablate", "--list"]) == 0
    out = capsys.readouterr().out
    for aid in PAPER_IDS:
        assert f"\n{aid} " in "\n" + out
    assert "configs/ablations/e2e_histopipe_tier1_migration.yaml" in out
    assert main(["ablate"]) == 2


@pytest.fixture(scope="module")
def tiny_suite(tmp_path_factory, compile_cache):
    """Every unit once at the tiny scale, in this process (one rollout worker: one device), then
    the suite measured and reported from them. The units share the module's persistent XLA
    cache, so programs compiled by one are loaded by the next."""
    from rhyme_lab.ablate import runner
    from rhyme_lab.ablate.units import run_unit, unit_json

    out = tmp_path_factory.mktemp("ablate")
    for name in registry.units_of(PAPER_IDS):
        run_unit(name, out, "tiny", ONE_DEVICE if UNITS[name].kind == "e2e" else ())
        assert unit_json(out, name).is_file()
    table, results = runner.run_suite("paper", scale="tiny", out=out, progress=False)
    return out, table, results


@pytest.mark.slow  # CI time: the tiny_suite fixture runs every ablation id (45 s)
def test_every_id_runs_one_tiny_step(tiny_suite):
    out, table, results = tiny_suite
    assert list(results) == PAPER_IDS
    for aid, r in results.items():
        assert r["status"] == "ok", (aid, r.get("reason"))
        assert r["figures"], aid
    text = table.read_text()
    for aid in PAPER_IDS:
        assert f"| {aid} |" in text
    from rhyme_lab import provenance

    stamps = [json.loads(p.read_text()) for p in (out / "units").glob("*.json")]
    commit = provenance.code_commit()
    assert {s["commit"] for s in stamps} == {commit}  # every unit ran at this checkout's code
    assert f"commit: {commit} |" in text and f"machine: {provenance.machine()} |" in text
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert {r["id"] for r in rows} == set(PAPER_IDS)
    # goodput: timed live (or an n/a naming the drafter's error); the replayed windows all present
    k2 = {f["variant"] for f in results["K2"]["figures"]}
    assert {"window=aimd", "window=mimd", "window=fixed"} <= k2
    assert (out / "speedup_bars.png").is_file() and (out / "gantt_e2e_fifo.png").is_file()


@pytest.mark.slow  # CI time: the tiny_suite fixture runs every ablation id (45 s)
def test_tiny_units_hold_real_counts(tiny_suite):
    out, _, results = tiny_suite
    fifo = json.loads((out / "units" / "e2e_fifo.json").read_text())["result"]
    assert [s["step"] for s in fifo["steps"]] == [1, 2]
    assert all(s["rollout/generated_tokens"] > 0 and s["wall_s"] > 0 for s in fifo["steps"])
    sess = json.loads((out / "units" / "real_session.json").read_text())["result"]
    assert [len(t["plain"]) for t in sess["temperatures"]] == [3, 2]
    assert sess["temperatures"][0]["plain"][0]["rows"] == 4
    k6 = {f["variant"]: f["n"] for f in results["K6"]["figures"] if f["metric"] == "acceptance"}
    assert k6 == {"history_depth=1": 6, "history_depth=2": 3}  # every (history, target) choice of 3 epochs


@pytest.mark.slow  # CI time: the tiny_suite fixture runs every ablation id (45 s)
def test_a_finished_suite_is_not_rerun(tiny_suite, monkeypatch):
    from rhyme_lab.ablate import runner

    out, _, _ = tiny_suite
    monkeypatch.setattr(runner, "spawn_unit", lambda *a, **k: pytest.fail("a finished unit was started again"))
    monkeypatch.setattr(runner, "MEASURES", {})  # a finished id is read back, not measured
    _, results = runner.run_suite("paper", scale="tiny", out=out, progress=False)
    assert all(r["status"] == "ok" for r in results.values())
    with pytest.raises(registry.AblationError, match="tiny"):
        runner.run_suite("paper", scale="quick", out=out, progress=False)


@pytest.mark.slow
def test_subprocess_units_get_their_fake_devices(tmp_path, compile_cache, monkeypatch):
    """The runner's own path: each unit in a child process; the end-to-end runs get 8 fake CPU
    devices and use 2 rollout workers at the tiny scale (about 2 minutes on 2 cores)."""
    from rhyme_lab.ablate import runner

    for k, v in compile_cache.items():
        monkeypatch.setenv(k, v)
    _, results = runner.run_suite("histopipe", scale="tiny", out=tmp_path, only="A1", progress=False)
    assert results["A1"]["status"] == "ok", results["A1"].get("reason")
    fifo = json.loads((tmp_path / "units" / "e2e_fifo.json").read_text())["result"]
    assert fifo["workers"] == 2
    sched = json.loads((Path(fifo["run_dir"]) / "schedule" / "step_000001.json").read_text())
    assert {iv[0] for iv in sched["intervals"]} == {0, 1}  # both workers rolled out
