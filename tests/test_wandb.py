"""Weights & Biases reporting (``run.report_to: [wandb]``): the W&B run's history is
``metrics.jsonl`` (same keys, ``step`` as the W&B step) and its config the run config; a run
without wandb installed works, and asking for it fails before any work naming the key.

The W&B run is real (``WANDB_MODE=offline``, every wandb directory under ``tmp_path``) and is read
back from the file wandb writes, ``<dir>/wandb/offline-run-*/run-<id>.wandb``. wandb 0.31 has no
Python reader for it (its Go service writes and syncs it), so ``_wandb_records`` reads the
container, LevelDB's log format (32 KiB blocks of ``crc32 u32, length u16, type u8`` chunk
headers; types 1 full, 2 first, 3 middle, 4 last) after wandb's 7-byte ``:W&B`` header, and parses
each record with wandb's own protobuf ``Record`` class.
"""

from __future__ import annotations

import json
import math
import struct
import sys
import time

import pytest

from rhyme_jax.config import ConfigError, load_config
from rhyme_jax.config.loader import to_dict
from rhyme_jax.io.metrics import read_metrics
from rhyme_jax.train.preflight import prepare
from rhyme_jax.train.reporting import metrics_writer

BLOCK = 32768
ROWS = [(0, "eval", {"eval/accuracy": 0.25, "eval/n": 4.0}),
        (1, "train", {"loss": 1.5, "reward/mean": 0.5, "time/train_s": 0.125}),
        (2, "train", {"loss": float("nan"), "reward/mean": 0.75, "time/train_s": 0.25}),
        (2, "eval", {"eval/accuracy": 0.5, "eval/n": 4.0})]


def _wandb_records(path):
    """wandb protobuf ``Record`` messages of an offline run file, in file order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    out, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block trailer: zero padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (length == 0 and kind == 0) or pos + 7 + length > len(data):  # zero fill, or still being written
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            out.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return out


def _offline_run(directory, wait_s=60.0):
    """(run record, history rows {key: value} with ``_step``, config {key: value}) of the only
    offline run under ``directory/wandb``. ``run.finish()`` can return before wandb's service has
    written the file (seen with wandb 0.31: only the 7-byte header yet), so this waits up to
    ``wait_s`` for the run's closing ``exit`` record."""
    (path,) = (directory / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + wait_s
    while True:
        records = _wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    history = [{"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    return run, history, config


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """wandb offline, its config / cache / data directories in ``tmp_path``, no WANDB_* naming."""
    pytest.importorskip("wandb")  # the test extra installs it
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    for var in ("WANDB_PROJECT", "WANDB_NAME", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def _nan_equal(a, b):
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def test_wandb_history_is_metrics_jsonl_and_config_is_the_run_config(offline):
    cfg = load_config(None, ["run.report_to=[wandb]", "run.name=wb", "grpo.steps=7"])
    run_dir = offline / "run"
    with metrics_writer(cfg, run_dir) as writer:
        for step, phase, metrics in ROWS:
            writer.log(step, metrics, phase=phase)
    assert not (run_dir / "tb").exists()  # report_to lists only wandb
    run, history, config = _offline_run(run_dir)
    assert (run.project, run.display_name, run.run_group, run.job_type) == ("rhyme-jax", "wb", "wb", "grpo")
    # wandb commits one history row per step; rows of one step (train + eval) merge into it
    expected = {}
    for row in read_metrics(run_dir):
        expected.setdefault(row["step"], {}).update({k: v for k, v in row.items() if k not in ("step", "phase")})
    got = {h["_step"]: {k: v for k, v in h.items() if not k.startswith("_")} for h in history}
    assert got.keys() == expected.keys() == {0, 1, 2}
    for step in expected:
        assert got[step].keys() == expected[step].keys()
        assert all(_nan_equal(got[step][k], v) for k, v in expected[step].items()), step
    assert math.isnan(got[2]["loss"]) and got[2]["eval/accuracy"] == 0.5
    wanted = to_dict(cfg)
    assert {k: config[k] for k in wanted} == wanted
    assert config["grpo"]["steps"] == 7 and config["run"]["report_to"] == ["wandb"]


def test_wandb_keys_and_environment_name_the_run(offline, monkeypatch):
    monkeypatch.setenv("WANDB_PROJECT", "env-project")
    monkeypatch.setenv("WANDB_DIR", str(offline / "env_dir"))
    cfg = load_config(None, ["run.report_to=[tensorboard,wandb]", "run.name=r", "run.wandb_name=named"])
    with metrics_writer(cfg, offline / "sft", job_type="sft") as writer:
        writer.log(1, {"loss": 2.0}, phase="sft")
    assert (offline / "sft" / "tb").is_dir()
    run, history, _ = _offline_run(offline / "env_dir")  # $WANDB_DIR: no key set
    assert (run.project, run.display_name, run.run_group, run.job_type) == ("env-project", "named-sft", "r", "sft")
    assert [(h["_step"], h["loss"]) for h in history] == [(1, 2.0)]
    cfg = load_config(None, ["run.report_to=[wandb]", f"run.wandb_dir={offline / 'key_dir'}",
                             "run.wandb_project=key-project"])
    with metrics_writer(cfg, offline / "run2") as writer:  # the keys win over the environment
        writer.log(1, {"loss": 1.0})
    run, _, _ = _offline_run(offline / "key_dir")
    assert (run.project, run.display_name) == ("key-project", "demo")


def test_without_wandb_installed(tmp_path, monkeypatch):
    """``sys.modules["wandb"] = None`` makes every ``import wandb`` raise ImportError."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = load_config(None, ["run.report_to=[wandb]"])
    with pytest.raises(ConfigError, match=r"^run\.report_to lists 'wandb' but the wandb package .*rhyme-jax\[wandb\]"):
        prepare(cfg)
    cfg = load_config(None, [])  # default: tensorboard only, wandb never imported
    assert prepare(cfg) is cfg
    with metrics_writer(cfg, tmp_path) as writer:
        writer.log(1, {"loss": 1.0})
    assert read_metrics(tmp_path) == [{"step": 1, "phase": "train", "loss": 1.0}]
    assert (tmp_path / "tb").is_dir()


@pytest.mark.parametrize("value", ["[mlflow]", "[wandb,wandb]"])
def test_report_to_checks_its_values(value):
    with pytest.raises(ConfigError, match=r"run\.report_to=.* must list distinct sinks out of \['tensorboard', 'wandb'\]"):
        load_config(None, [f"run.report_to={value}"])
