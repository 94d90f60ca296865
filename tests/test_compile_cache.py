"""Persistent compilation cache: where it lives, its off switch, and a second process loading
what the first compiled (subprocesses with RHYME_JAX_COMPILE_CACHE at tmp_path; never the user's
cache)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rhyme_jax import compile_cache
from rhyme_jax.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys
import jax, jax.numpy as jnp
from rhyme_jax import compile_cache
from rhyme_jax.compile_count import CompileCounter
path = compile_cache.enable("")
with CompileCounter() as c:
    f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum() * 3.0)
    f(jnp.ones((8, 8))).block_until_ready()
print(json.dumps(dict(path=str(path), **c.stats(), count=c.count)))
"""


def test_resolve_default_setting_env_and_off(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("RHYME_JAX_CACHE", str(tmp_path / "root"))
    assert compile_cache.resolve("") == tmp_path / "root" / "compile_cache"
    assert compile_cache.resolve("off") is None and compile_cache.resolve("OFF") is None
    assert compile_cache.resolve(str(tmp_path / "mine")) == tmp_path / "mine"
    monkeypatch.setenv(compile_cache.ENV, "off")  # the environment wins over the config
    assert compile_cache.resolve(str(tmp_path / "mine")) is None
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
    assert compile_cache.resolve("off") == tmp_path / "env"


def test_config_field_defaults_and_validation(tmp_path, monkeypatch):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    assert load_config(str(REPO / "configs" / "default.yaml")).run.compile_cache == ""
    cfg = load_config(str(REPO / "configs" / "default.yaml"), ["run.compile_cache=off"])
    assert compile_cache.resolve(cfg.run.compile_cache) is None  # YAML reads off as false: both mean off
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="run.compile_cache"):
        load_config(str(REPO / "configs" / "default.yaml"), [f"run.compile_cache={f}"])


def _child(env_value: str) -> dict:
    env = {**os.environ, compile_cache.ENV: env_value, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_loads_instead_of_compiling(tmp_path):
    cache = tmp_path / "cc"
    first = _child(str(cache))
    assert first["path"] == str(cache) and first["compiled"] >= 1 and first["loaded_from_cache"] == 0
    entries = list(cache.iterdir())
    assert entries  # the program was written
    second = _child(str(cache))
    assert second["compiled"] == 0 and second["loaded_from_cache"] == second["count"] >= 1
    assert sorted(cache.iterdir()) == sorted(entries)  # nothing new compiled, nothing new written
    off = _child("off")
    assert off["path"] == "None" and off["compiled"] >= 1 and off["loaded_from_cache"] == 0
