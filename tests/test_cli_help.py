"""``rhyme-jax --help``, every command's help (one line per command and flag, examples), and
``train --dry-run`` (resolved config, memory plan, program count; nothing written)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rhyme_jax.cli import main
from rhyme_jax.cli.main import parser

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_test.yaml")


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_top_level_help_lists_every_command_with_examples(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "rhyme-jax demo" in out
    for name in _commands():
        assert f"    {name}" in out, name


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_command_has_help_examples_and_flag_help(name):
    sp = _commands()[name]
    assert sp.description, f"{name}: no one-line description"
    assert sp.epilog and sp.epilog.startswith("examples:") and f"rhyme-jax {name}" in sp.epilog, name
    undocumented = [a.dest for a in sp._actions if not a.help and not isinstance(a, argparse._SubParsersAction)]
    assert not undocumented, f"{name}: flags without help: {undocumented}"
    for nested in (a for a in sp._actions if isinstance(a, argparse._SubParsersAction)):
        for sub_name, sub in nested.choices.items():  # e.g. `models get`: its own help and examples
            assert sub.description and sub.epilog and sub.epilog.startswith("examples:"), f"{name} {sub_name}"
            assert f"rhyme-jax {name} {sub_name}" in sub.epilog, f"{name} {sub_name}"


def test_train_dry_run_prints_config_memory_and_programs_and_writes_nothing(tmp_path, capsys):
    runs = tmp_path / "runs"
    assert main(["train", "--config", TINY, "--set", f"run.runs_dir={runs}", "--set", "run.name=dry",
                 "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# resolved config" in out and "samples_per_prompt:" in out
    assert "# memory plan" in out and "peak" in out and "GiB per device" in out
    assert "# rollout step programs:" in out and "decode" in out
    assert not runs.exists()


def test_a_bad_override_fails_in_one_line_before_any_work(tmp_path, capsys):
    assert main(["train", "--config", TINY, "--set", "grpo.steps=0", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "grpo.steps" in err


def test_a_recipe_key_marked_required_fails_before_any_work(tmp_path, capsys):
    """``configs/gsm8k_qwen2.5_1.5b.yaml`` marks ``model.path: ???``: the training commands refuse
    it without ``--set model.path=...`` (it used to train the tiny demo model on GSM8K), naming
    the file and the key, and write nothing; tools that need only shapes still read it (the
    schema default), and a config that includes it inherits the mark."""
    from rhyme_jax.config import load_config, required_keys

    qwen = REPO / "configs" / "gsm8k_qwen2.5_1.5b.yaml"
    runs = tmp_path / "runs"
    for command in ("train", "sft", "demo"):
        assert main([command, "--config", str(qwen), "--set", f"run.runs_dir={runs}", "--dry-run"]
                    if command != "sft" else [command, "--config", str(qwen), "--set", f"run.runs_dir={runs}"]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "gsm8k_qwen2.5_1.5b.yaml" in err and "--set model.path=" in err, err
    assert not runs.exists()
    assert required_keys(qwen) == ["model.path"] and load_config(qwen).model.path == ""
    assert required_keys(REPO / "configs" / "ablations" / "gpu" / "e2e_fifo.yaml") == ["model.path"]
    assert required_keys(TINY) == []


def test_export_of_a_missing_run_is_one_line(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "nope" in err
    assert not (tmp_path / "out").exists()


def test_the_lab_commands_have_help_and_examples(capsys):
    """``python -m rhyme_lab`` (the measurements, outside the product's CLI): every command has a
    description, examples naming it and help for each flag; the product CLI has none of them."""
    from rhyme_lab.cli.main import parser as lab_parser

    sub = next(a for a in lab_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == {"ablate", "analyze", "replay-drafts"}
    for name, sp in sub.choices.items():
        assert sp.description and sp.epilog.startswith("examples:") and f"python -m rhyme_lab {name}" in sp.epilog
        assert not [a.dest for a in sp._actions if not a.help], name
    assert not set(sub.choices) & set(_commands())
