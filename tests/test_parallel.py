"""Mesh sharding and multi-host (issue 5): rules, layouts, resharding, checkpoints, two processes.

The sharded checks need several devices, so they run in subprocesses with fake CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count``): tests/parallel_cases.py (8 devices) and
tests/multihost_case.py (one process with 4 devices vs two processes with 2 devices each over
``jax.distributed`` on localhost).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from rhyme_jax.config import ConfigError, load_config
from rhyme_jax.model.config import ModelConfig
from rhyme_jax.parallel import distributed
from rhyme_jax.train.state_memory import state_memory
from rhyme_jax.parallel.mesh import MeshConfigError, mesh_shape, rollout_meshes
from rhyme_jax.parallel.rules import ShardingRuleError, logical_to_spec, param_logical_axes
from rhyme_jax.rollout.engine import RolloutResult
from rhyme_jax.rollout.gather import merge_results
from conftest import selected_cases

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _env(devices: int) -> dict:
    return dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}",
                JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))


# ------------------------------------------------------------------ rules, meshes, config
def test_mesh_shape_fills_and_rejects():
    assert mesh_shape(1, -1, 2, 8) == (1, 4, 2)
    assert mesh_shape(2, 2, 2, 8) == (2, 2, 2)
    for bad, field in [((0, 1, 1), "parallel.data"), ((-1, -1, 1), "both -1"), ((4, 4, 1), "16 devices"),
                       ((1, -1, 3), "multiple")]:
        with pytest.raises(MeshConfigError, match=field):
            mesh_shape(*bad, 8)
    with pytest.raises(MeshConfigError, match="rollout_workers=2 x parallel.rollout_tensor=1"):
        rollout_meshes(1, 2)  # this process has one device


def test_logical_rules_drop_missing_axes_and_uneven_dims():
    mesh = {"data": 2, "fsdp": 4, "tensor": 2}
    assert logical_to_spec(("embed", "heads"), (32, 16), mesh) == P("fsdp", "tensor")
    assert logical_to_spec(("batch", None), (16, 5), mesh) == P(("data", "fsdp"), None)
    assert logical_to_spec(("embed", "mlp"), (30, 16), mesh) == P(None, "tensor")  # 30 % 4 != 0
    assert logical_to_spec(("heads", "mlp"), (8, 8), mesh) == P("tensor", None)  # axis used once
    assert logical_to_spec(("embed", "heads"), (32, 16), {"tensor": 2}) == P(None, "tensor")
    assert logical_to_spec(("vocab", "embed"), (64, 32), {"tensor": 1, "fsdp": 1}) == P(None, None)
    with pytest.raises(ShardingRuleError, match="no sharding rule for logical axis 'experts'"):
        logical_to_spec(("experts",), (4,), mesh)


def test_param_rules_cover_every_parameter_and_name_unknown_ones():
    # stacked decoder blocks: a leading "layer" axis (never split)
    assert param_logical_axes(("layers", "attn", "k_proj", "kernel"), 3) == ("layer", "embed", "kv_heads")
    assert param_logical_axes(("layers", "mlp", "down_proj", "kernel"), 3) == ("layer", "mlp", "embed")
    assert param_logical_axes(("final_norm", "weight"), 1) == (None,)
    with pytest.raises(ShardingRuleError, match="layers/router/kernel"):
        param_logical_axes(("layers", "router", "kernel"), 3)
    with pytest.raises(ShardingRuleError, match="rank 2"):  # an unstacked block kernel
        param_logical_axes(("layers", "attn", "k_proj", "kernel"), 2)
    with pytest.raises(ShardingRuleError, match="rank 3"):
        param_logical_axes(("embed", "embedding"), 3)


def test_parallel_config_is_validated_at_load(tmp_path):
    cfg = ROOT / "configs" / "tiny_test.yaml"
    with pytest.raises(ConfigError, match="parallel.fsdp=0"):
        load_config(cfg, ["parallel.fsdp=0"])
    # multi-host settings are checked before any work (train.preflight.prepare), not by the YAML load
    from rhyme_jax.train.preflight import prepare

    with pytest.raises(ConfigError, match="parallel.num_processes, parallel.process_id not set"):
        prepare(load_config(cfg, ["parallel.coordinator_address=localhost:1234"]))
    with pytest.raises(ConfigError, match="process_id=2"):
        prepare(load_config(cfg, ["parallel.coordinator_address=h:1", "parallel.num_processes=2",
                                  "parallel.process_id=2"]))


def test_distributed_settings_from_environment(monkeypatch):
    cfg = load_config(ROOT / "configs" / "tiny_test.yaml")
    assert distributed.settings(cfg.parallel) is None
    monkeypatch.setenv("RHYME_COORDINATOR_ADDRESS", "10.0.0.1:9999")
    monkeypatch.setenv("RHYME_NUM_PROCESSES", "4")
    monkeypatch.setenv("RHYME_PROCESS_ID", "3")
    assert distributed.settings(cfg.parallel) == {"coordinator_address": "10.0.0.1:9999",
                                                  "num_processes": 4, "process_id": 3}
    # Single process: the groups of a step split over the local workers in order.
    parts = distributed.process_groups(7, 3)
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4], [5, 6]]


def test_merge_results_sums_counts_and_recomputes_rates():
    def res(tokens, drafted, accepted, steps, passes):
        stats = dict(prefill_tokens=3, generated_tokens=sum(map(len, tokens)), decode_steps=passes - 1,
                     prefill_steps=1, preemptions=0, skipped=0, drafted_tokens=drafted,
                     accepted_tokens=accepted, drafting_seconds=0.5, sequence_steps=steps,
                     forward_passes=passes, seconds=2.0)
        return RolloutResult([np.array(t) for t in tokens], [np.zeros(len(t)) for t in tokens],
                             ["eos"] * len(tokens), stats)

    out = merge_results([res([[1, 2], [3]], 10, 4, 3, 5), res([[4, 5, 6]], 6, 4, 2, 9)])
    assert [t.tolist() for t in out.tokens] == [[1, 2], [3], [4, 5, 6]]
    assert out.stats["generated_tokens"] == 6 and out.stats["forward_passes"] == 14
    assert out.stats["acceptance_rate"] == pytest.approx(8 / 16)
    assert out.stats["tokens_per_forward"] == pytest.approx(6 / 5)
    assert out.stats["workers"] == 2 and out.stats["max_worker_forward_passes"] == 9


def test_state_memory_divides_by_the_mesh():
    cfg = ModelConfig(family="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True,
                      tie_word_embeddings=True, eos_token_ids=(1,))
    one = state_memory(cfg, {"fsdp": 1})
    eight = state_memory(cfg, {"fsdp": 8})
    n = one["params"]
    # embed 256*64, per layer: q 64*64+64, k/v 64*32+32 each, o 64*64, mlp 3*64*128, norms 2*64; final norm 64
    layer = 64 * 64 + 64 + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert n == 256 * 64 + 2 * layer + 64
    assert one["param_bytes_per_device"] == one["param_bytes_total"] == 4 * n
    assert one["opt_bytes_total"] == 2 * 4 * n + 8  # Adam mu + nu; int32 counts of Adam and the schedule
    # Matrices split 8 ways over their hidden dim; vectors over 64 (embed) too; biases of 32/64 too.
    assert eight["param_bytes_per_device"] < one["param_bytes_total"] / 7


# ------------------------------------------------------------------ 8 fake devices
@pytest.fixture(scope="module")
def parallel_cases(tmp_path_factory, request):
    out = tmp_path_factory.mktemp("parallel") / "cases.json"
    proc = subprocess.run([sys.executable, str(TESTS / "parallel_cases.py"), str(out), *selected_cases(request)],
                          env=_env(8),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", ["create_sharded", "train_step", "reshard_roundtrip",
                                  pytest.param("rollout_tensor_parallel", marks=pytest.mark.slow),  # CI time: the
                                  # sharded attention over the tensor axis stays (tests/test_attention_api.py)
                                  "checkpoint_cross_mesh",
                                  pytest.param("hf_loader_sharded", marks=pytest.mark.slow),  # CI time:
                                  pytest.param("trainer_layouts", marks=pytest.mark.slow)])  # the engine and
# train-step cases above shard the same model; trainer_layouts runs two tiny trainers, hf_loader imports torch
def test_sharded_equals_single_device(parallel_cases, case):
    """See the docstring of ``case_<case>`` in tests/parallel_cases.py."""
    result = parallel_cases[case]
    assert result["ok"], result["detail"]


# ------------------------------------------------------------------ two processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # CI time (70 s: three child processes); test_distributed_settings_from_environment stays
def test_two_processes_match_one_process(tmp_path):
    """jax.distributed over localhost (2 processes x 2 CPU devices, gloo) runs one GRPO step and
    checkpoint with the same rollouts and bit-identical parameters as one process with 4
    devices and the same layout (fsdp=2 x tensor=2, two rollout workers of tensor=2)."""
    script, port = str(TESTS / "multihost_case.py"), str(_free_port())
    procs = [subprocess.Popen([sys.executable, script, str(tmp_path / f"p{i}.json"), str(tmp_path), "multi",
                               str(i), "2", port], env=_env(2), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    single = subprocess.run([sys.executable, script, str(tmp_path / "single.json"), str(tmp_path), "single"],
                            env=_env(4), capture_output=True, text=True, timeout=600)
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert single.returncode == 0, single.stderr[-3000:]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    one = json.loads((tmp_path / "single.json").read_text())
    two = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2)]
    assert (one["processes"], one["devices"]) == (1, 4)
    assert [(r["processes"], r["devices"]) for r in two] == [(2, 4), (2, 4)]
    assert two[0]["responses"] == one["responses"] and sum(map(len, one["responses"])) > 0
    assert two[0]["rewards"] == one["rewards"]
    for r in two:  # both processes hold the same (global) result
        np.testing.assert_array_equal(np.array(r["checksums"]), np.array(one["checksums"]))
        for key in ("loss", "grad_norm", "reward/mean", "rollout/generated_tokens", "rollout/workers"):
            assert r["metrics"][key] == one["metrics"][key], key
    assert two[0]["saved_step"] == 1
    assert (tmp_path / "multi" / "checkpoints" / "1" / "commit_success.txt").is_file()


def test_memory_command_plans_the_real_recipe(capsys):
    """``rhyme-jax memory`` sizes Qwen2.5-1.5B under fsdp=8 from shapes alone."""
    from rhyme_jax.cli import main

    assert main(["memory", "--config", str(ROOT / "configs" / "gsm8k_qwen2.5_1.5b.yaml"), "--model-config",
                 str(ROOT / "configs" / "models" / "qwen2.5-1.5b"), "--devices", "8", "--no-update"]) == 0
    out = capsys.readouterr().out
    assert "1.544 B parameters, float32 master weights computing in bfloat16" in out
    assert "data=1 x fsdp=8 x tensor=1" in out
    # 1,543,714,304 float32 params = 5.751 GiB; fsdp=8 leaves an eighth per device (every dim divides).
    assert "params        5.751 GiB total     0.719 GiB per device" in out
    assert "optimizer    11.502 GiB total     1.439 GiB per device" in out
    assert "params 2.875 GiB per device in bfloat16" in out  # a rollout worker's copy


def test_memory_json_reads_the_compiled_update(capsys):
    """``--json`` reports the update's XLA temporaries; remat and logit chunking shrink them."""
    import json

    from rhyme_jax.cli import main

    def temp(*sets, rows=8):
        args = ["memory", "--config", str(ROOT / "configs" / "tiny_test.yaml"), "--rows", "8", "--tokens", "128",
                "--set", "data.tokenizer_vocab_size=4096", "--json", "--mean-tokens", "40"]
        for s in sets:
            args += ["--set", s]
        assert main(args) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["rows"] == rows and report["tokens"] == 128
        assert report["peak_bytes_per_device"] == (report["param_bytes_per_device"] + report["opt_bytes_per_device"]
                                                   + report["update_temp_bytes"])
        return report["update_temp_bytes"]

    plain = temp()
    bounded = temp("grpo.remat=true", "grpo.logit_chunk=128")
    assert plain > 2 * bounded > 0
    packed = temp("grpo.padding_free=true", rows=3)  # 8 rows of 40 real tokens in rows of 128
    assert plain > 2 * packed > 0
