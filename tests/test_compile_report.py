"""``rhyme-jax compile-report``: lists the enumerated step programs and times a sample of them
with abstract weights (tiny model: seconds)."""

import json
from pathlib import Path

from rhyme_jax.cli import main
from rhyme_jax.cli.compile_report import sample_programs
from rhyme_jax.config import load_config
from rhyme_jax.rollout.shapes import programs_from_config

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_test.yaml")


def test_json_report_times_a_sample(capsys):
    assert main(["compile-report", "--config", TINY, "--set", "spec.enabled=true", "--sample", "3", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    progs = programs_from_config(load_config(TINY, ["spec.enabled=true"]))
    assert rep["programs"] == len(progs) == len(rep["shapes"]) == sum(rep["by_kind"].values())
    assert set(rep["by_kind"]) == {"prefill", "decode", "verify"} and rep["spec"]
    assert len(rep["sample_compile_s"]) == 3 and all(s > 0 for s in rep["sample_compile_s"])
    assert {t["kind"] for t in rep["sampled"]} == {"prefill", "decode", "verify"}  # spread over kinds
    assert rep["model"] == "tiny demo model" and rep["layers"] == 2


def test_real_recipe_listing_without_compiling(capsys):
    """The 1.5B recipe's architecture from configs/models (no weights): 36 programs."""
    assert main(["compile-report", "--config", str(REPO / "configs" / "gsm8k_qwen2.5_1.5b.yaml"),
                 "--model-config", str(REPO / "configs" / "models" / "qwen2.5-1.5b"), "--sample", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rollout step programs: 36 (6 decode, 12 prefill, 18 verify); HistoSpec on")
    assert "28 layers" in out


def test_sample_is_spread_and_bad_arguments_fail(capsys):
    progs = programs_from_config(load_config(TINY, ["spec.enabled=true"]))
    picked = sample_programs(progs, 5)
    assert len(picked) == len(set(picked)) == 5 and set(picked) <= set(progs)
    assert len(sample_programs(progs, 10_000)) == len(progs)
    assert main(["compile-report", "--config", TINY, "--sample", "-1"]) == 2
    assert main(["compile-report", "--config", TINY, "--set", "rollout.max_slots=0"]) == 2
    assert "config error" in capsys.readouterr().err
