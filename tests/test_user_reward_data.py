"""Your own reward (``reward.fn`` / ``reward.kwargs`` / ``reward.batched``) and your own data
(``data.source: jsonl`` / ``parquet`` with ``prompt_field`` / ``answer_field`` /
``metadata_fields``): resolution, errors, loading, the shipped example (examples/my_run.yaml) and
one short ``rhyme-jax train`` run with both (docs/custom_reward.md, docs/custom_data.md)."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from rhyme_jax.config import ConfigError, load_config
from rhyme_jax.data import (DataError, Problem, RewardError, choose_reward, load_problems, score_batch,
                            task_reward)

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_test.yaml")
_names = itertools.count()

REWARD_SOURCE = '''
import json

def reward(response, problem, *, token, log=""):
    """1.0 when the response contains ``token``; logs what it was called with."""
    if log:
        with open(log, "a") as fh:
            fh.write(json.dumps({"response": response, "id": problem.id, "answer": problem.answer,
                                 "metadata": problem.metadata}) + "\\n")
    return 1.0 if token in response else 0.0

def batched(responses, problems, *, token):
    return [1.0 if token in r else 0.0 for r in responses]

def wrong_length(responses, problems):
    return [0.0]

def nan(response, problem):
    return float("nan")

def one_argument(response):
    return 0.0

NOT_CALLABLE = 3
'''


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """A reward module written outside the package (tmp_path, put on sys.path); its unique name."""
    name = f"user_reward_{next(_names)}"
    (tmp_path / f"{name}.py").write_text(REWARD_SOURCE)
    monkeypatch.setattr(sys, "path", list(sys.path))  # undo the loader's working-directory entry too
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _rows(n: int, start: int = 0) -> list[dict]:
    """``n`` JSONL records: plain and GSM8K-style answers, two metadata fields."""
    out = []
    for i in range(start, start + n):
        a, b = i % 7 + 1, i % 5 + 2
        answer = str(a + b) if i % 2 else f"{a} + {b} = {a + b}\n#### {a + b}"
        out.append({"prompt": f"{a} + {b} = ?", "gold": answer, "level": i % 3, "tag": f"t{i}"})
    return out


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _data_overrides(train: Path, test: Path, source: str = "jsonl") -> list[str]:
    return [f"data.source={source}", f"data.train_path={train}", f"data.test_path={test}",
            "data.prompt_field=prompt", "data.answer_field=gold", "data.metadata_fields=[level,tag]"]


# ------------------------------------------------------------------------------------- reward
def test_yaml_reward_is_imported_and_called_with_response_problem_and_kwargs(reward_module, tmp_path):
    log = tmp_path / "calls.jsonl"
    cfg = load_config(TINY, [f"reward.fn={reward_module}:reward", "reward.kwargs.token=XYZ",
                             f"reward.kwargs.log={log}"])
    fn = choose_reward(cfg, None)
    problem = Problem(3, "q?", "#### 5", "5", {"level": 2})
    assert score_batch(fn, ["has XYZ", "has none"], [problem, problem]) == [1.0, 0.0]
    assert fn("XYZ", problem) == 1.0  # the per-sample form the trainer's hook type has
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[0] == {"response": "has XYZ", "id": 3, "answer": "5", "metadata": {"level": 2}}
    assert len(calls) == 3


def test_batched_reward_gets_lists_and_is_checked(reward_module):
    cfg = load_config(TINY, [f"reward.fn={reward_module}:batched", "reward.batched=true", "reward.kwargs.token=a"])
    fn = task_reward(cfg)
    p = Problem(0, "q", "#### 1", "1")
    assert score_batch(fn, ["a", "b", "ca"], [p, p, p]) == [1.0, 0.0, 1.0]
    bad = task_reward(load_config(TINY, [f"reward.fn={reward_module}:wrong_length", "reward.batched=true"]))
    with pytest.raises(RewardError, match=r"returned 1 rewards for 2 responses"):
        score_batch(bad, ["a", "b"], [p, p])
    with pytest.raises(RewardError, match=r"returned nan for problem id 0: a reward must be a finite number"):
        task_reward(load_config(TINY, [f"reward.fn={reward_module}:nan"]))("a", p)


def test_empty_reward_fn_is_the_builtin_reward():
    cfg = load_config(TINY, ["data.answer_extraction=last_number"])
    p = Problem(0, "q", "#### 12", "12")
    assert task_reward(cfg)("so 12 apples", p) == 1.0
    assert task_reward(load_config(TINY))("so 12 apples", p) == 0.0  # marker: no #### and no \boxed


@pytest.mark.parametrize("target, needle", [
    ("no_such_module_xyz:reward", "module 'no_such_module_xyz' not found (searched the working directory"),
    ("{mod}:missing", "has no attribute 'missing'"),
    ("{mod}:NOT_CALLABLE", "'NOT_CALLABLE' is not callable (its type is int)"),
    ("{mod}:one_argument", "wrong signature (response) for the call fn(response, problem, **reward.kwargs)"),
    ("{mod}:reward", "missing a required argument: 'token'"),  # reward.kwargs lacks token
])
def test_unusable_reward_fn_fails_in_one_line_naming_the_key(reward_module, target, needle):
    spec = target.format(mod=reward_module)
    cfg = load_config(TINY, [f"reward.fn={spec}"])
    with pytest.raises(RewardError) as info:
        task_reward(cfg)
    msg = str(info.value)
    assert msg.startswith(f"reward.fn={spec!r}: ") and needle in msg and "\n" not in msg
    assert isinstance(info.value, ConfigError) and isinstance(info.value, DataError)


def test_reward_module_that_fails_to_import_is_named(tmp_path, monkeypatch):
    (tmp_path / "broken_user_reward.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match=r"^reward.fn='broken_user_reward:f': importing 'broken_user_reward' "
                                          r"failed: ModuleNotFoundError: No module named 'no_such_dependency_xyz'$"):
        task_reward(load_config(TINY, ["reward.fn=broken_user_reward:f"]))


def test_reward_module_is_found_in_the_working_directory(tmp_path, monkeypatch):
    """The ``rhyme-jax`` console script has no working-directory entry on sys.path; the loader
    adds one (as ``python -m`` has it)."""
    (tmp_path / "cwd_user_reward.py").write_text("def r(response, problem):\n    return 0.5\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.chdir(tmp_path)
    assert task_reward(load_config(TINY, ["reward.fn=cwd_user_reward:r"]))("x", Problem(0, "q", "", "1")) == 0.5


@pytest.mark.parametrize("override, needle", [
    ("reward.fn=not a spec", "reward.fn='not a spec' must be 'package.module:function'"),
    ("reward.fn=module_only", "reward.fn='module_only' must be 'package.module:function'"),
    ("reward.kwargs.x=1", "reward.kwargs={'x': 1} needs reward.fn"),
    ("reward.batched=true", "reward.batched=True needs reward.fn"),
    ("data.source=jsonl", "data.train_path='' must name a jsonl file for data.source='jsonl'"),
    ("data.prompt_field=''", "data.prompt_field='' must name a record field"),
])
def test_bad_reward_and_data_keys_fail_when_the_config_loads(override, needle):
    with pytest.raises(ConfigError, match=None) as info:
        load_config(TINY, [override])
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_python_hook_and_yaml_reward_are_exclusive(reward_module, tmp_path):
    from rhyme_jax.train.trainer import GRPOTrainer

    cfg = load_config(TINY, [f"reward.fn={reward_module}:reward", "reward.kwargs.token=a",
                             f"run.runs_dir={tmp_path / 'runs'}"])
    with pytest.raises(RewardError, match=r"reward.fn=.* and the Python reward_fn= hook are both set"):
        GRPOTrainer(cfg, reward_fn=lambda response, problem: 0.0)
    assert not (tmp_path / "runs").exists()  # failed before any work
    hook = lambda response, problem: 0.25  # noqa: E731
    assert choose_reward(load_config(TINY), hook) is hook


# --------------------------------------------------------------------------------------- data
def test_jsonl_dataset_loads_with_field_mapping_and_metadata(tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", _rows(20))
    test = _write_jsonl(tmp_path / "test.jsonl", _rows(6, start=100))
    cfg = load_config(TINY, _data_overrides(train, test) + ["data.num_eval=4"])
    tr, ev = load_problems(cfg.data)
    assert len(tr) == 20 and len(ev) == 4 and [p.id for p in tr] == list(range(20))
    for p, row in zip(tr, _rows(20)):
        a, b = (int(x) for x in row["prompt"].split(" = ")[0].split(" + "))
        assert p.question == row["prompt"] and p.answer == str(a + b)
        assert p.metadata == {"level": row["level"], "tag": row["tag"]}
        assert p.solution == (row["gold"] if "####" in row["gold"] else f"#### {a + b}")
    assert ev[0].question == _rows(1, start=100)[0]["prompt"]


def test_metadata_reaches_the_reward(reward_module, tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", _rows(20))
    log = tmp_path / "calls.jsonl"
    cfg = load_config(TINY, _data_overrides(train, train) + [
        f"reward.fn={reward_module}:reward", "reward.kwargs.token=t", f"reward.kwargs.log={log}"])
    tr, _ = load_problems(cfg.data)
    score_batch(task_reward(cfg), ["a", "b"], tr[5:7])
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c["metadata"] for c in calls] == [{"level": 2, "tag": "t5"}, {"level": 0, "tag": "t6"}]


@pytest.mark.parametrize("answer, expected", [
    ("42", "42"), (" 1,000 ", "1000"), ("$7", "7"), (42, "42"), (0.5, "0.5"),
    ("\\frac{1}{2}", "\\frac{1}{2}"), ("work\n#### 1,234", "1234"), ("Paris", "Paris"),
])
def test_answers_are_normalised_like_gsm8k(tmp_path, answer, expected):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": answer}])
    cfg = load_config(TINY, ["data.source=jsonl", f"data.train_path={path}", f"data.test_path={path}"])
    assert load_problems(cfg.data)[0][0].answer == expected


@pytest.mark.parametrize("line, needle", [
    ("{not json", ":3: not valid JSON"),
    ('["a list"]', ":3: expected a JSON object, got list"),
    ('{"gold": "1", "level": 0, "tag": "x"}', ":3: missing field 'prompt' (data.prompt_field)"),
    ('{"prompt": "q", "level": 0, "tag": "x"}', ":3: missing field 'gold' (data.answer_field)"),
    ('{"prompt": "q", "gold": "1", "tag": "x"}', ":3: missing field 'level' (data.metadata_fields)"),
    ('{"prompt": 5, "gold": "1", "level": 0, "tag": "x"}', ":3: field 'prompt' (data.prompt_field) must be a "
                                                          "non-empty string"),
    ('{"prompt": "q", "gold": null, "level": 0, "tag": "x"}', ":3: field 'gold' (data.answer_field) must be a "
                                                             "string or a number, got NoneType"),
    ('{"prompt": "q", "gold": "x ####  ", "level": 0, "tag": "x"}', ":3: field 'gold' (data.answer_field) has an "
                                                                   "empty final answer after '####'"),
])
def test_malformed_lines_fail_naming_file_line_and_field(tmp_path, line, needle):
    rows = _rows(2)
    path = _write_jsonl(tmp_path / "bad.jsonl", [rows[0], "", line, rows[1]])  # line 2 blank: skipped
    cfg = load_config(TINY, _data_overrides(path, path))
    with pytest.raises(DataError) as info:
        load_problems(cfg.data)
    assert str(info.value).startswith(f"{path}{needle}") and "\n" not in str(info.value)


def test_missing_and_empty_files_fail_naming_them(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    cfg = load_config(TINY, _data_overrides(empty, empty))
    with pytest.raises(DataError, match=r"empty.jsonl: no records \(empty file\)"):
        load_problems(cfg.data)
    cfg = load_config(TINY, _data_overrides(tmp_path / "nope.jsonl", empty))
    with pytest.raises(DataError, match=r"nope.jsonl: data file not found \(data.source='jsonl'"):
        load_problems(cfg.data)


def test_parquet_dataset_loads_or_names_pyarrow(tmp_path, monkeypatch):
    path = tmp_path / "d.parquet"
    cfg = load_config(TINY, _data_overrides(path, path, source="parquet"))
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        pa = None
    if pa is not None:
        pq.write_table(pa.Table.from_pylist(_rows(5)), path)
        tr, _ = load_problems(cfg.data)
        jsonl = _write_jsonl(tmp_path / "d.jsonl", _rows(5))
        assert tr == load_problems(load_config(TINY, _data_overrides(jsonl, jsonl)).data)[0]
        assert tr[1].metadata == {"level": 1, "tag": "t1"}
    path.write_text("not parquet")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if pyarrow were not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"data.source='parquet' needs pyarrow: pip install pyarrow"):
        load_problems(cfg.data)


# ------------------------------------------------------------------------------------ example
def test_the_documented_example_loads_its_data_and_reward(monkeypatch):
    """examples/my_run.yaml (docs/custom_reward.md, docs/custom_data.md): the SmolLM2 recipe with
    the example JSONL data and reward; loaded and scored, not trained."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(REPO)  # the example's paths are relative to the repository root
    cfg = load_config("examples/my_run.yaml")
    recipe = load_config("configs/arith_smollm2_135m.yaml")
    assert cfg.model == recipe.model and cfg.rollout == recipe.rollout  # inherited via defaults
    assert cfg.data.source == "jsonl" and cfg.reward.fn == "examples.my_reward:reward"
    train, held_out = load_problems(cfg.data)
    assert len(train) == 20 and len(held_out) == 8
    assert all(set(p.metadata) == {"unit", "level"} for p in train)
    fn = task_reward(cfg)
    p = train[1]
    unit = p.metadata["unit"]
    assert score_batch(fn, [f"So the answer is {p.answer} {unit}.", f"It is {p.answer}.", "It is 999."],
                       [p, p, p]) == [1.0, pytest.approx(0.8), 0.0]
    for doc in ("docs/custom_reward.md", "docs/custom_data.md"):
        assert "rhyme-jax train --config examples/my_run.yaml" in (REPO / doc).read_text()


# ------------------------------------------------------------------------------- end to end
@pytest.mark.slow  # CI time (36 s in a fresh clone: two GRPO steps); the loaders, the reward hook and the CLI's early failure are tested above and below
def test_rhyme_jax_train_with_jsonl_data_and_yaml_reward(reward_module, tmp_path, monkeypatch, compile_cache, capsys):
    """Two GRPO steps of ``rhyme-jax train`` on the tiny config with a JSONL dataset and a YAML
    reward: the saved rewards are the reward module's verdicts on the saved responses, and the
    reward saw the records' metadata."""
    from rhyme_jax.cli import main
    from rhyme_jax.io.rollout_log import load_rollouts
    from rhyme_jax.model.tokenizer import Tokenizer

    train = _write_jsonl(tmp_path / "train.jsonl", _rows(20))
    test = _write_jsonl(tmp_path / "test.jsonl", _rows(4, start=20))
    log = tmp_path / "calls.jsonl"
    runs = tmp_path / "runs"
    args = ["train", "--config", TINY, "--set", f"run.runs_dir={runs}", "--set", "grpo.steps=2"]
    for item in _data_overrides(train, test) + ["data.num_eval=2", f"reward.fn={reward_module}:reward",
                                                "reward.kwargs.token='1'", f"reward.kwargs.log={log}"]:
        args += ["--set", item]
    assert main(args) == 0, capsys.readouterr().err
    run_dir = runs / "tiny"
    tok = Tokenizer.from_file(run_dir / "tokenizer.json")
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    tags = {c["metadata"]["tag"] for c in calls}
    assert {"t20", "t21"} <= tags and tags & {f"t{i}" for i in range(20)}  # held-out and train problems
    for step in (1, 2):
        roll = load_rollouts(run_dir, step)
        texts = [tok.decode(t) for t in roll["responses"]]
        np.testing.assert_array_equal(roll["rewards"], [1.0 if "1" in t else 0.0 for t in texts])
    saved = load_config(run_dir / "config.yaml")
    assert saved.reward.fn == f"{reward_module}:reward" and saved.data.metadata_fields == ["level", "tag"]


def test_rhyme_jax_train_with_a_bad_reward_fails_before_any_work(tmp_path, capsys):
    from rhyme_jax.cli import main

    runs = tmp_path / "runs"
    assert main(["train", "--config", TINY, "--set", f"run.runs_dir={runs}",
                 "--set", "reward.fn=no_such_module_xyz:reward"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err  # one line, checked before any work (train.preflight.prepare)
    assert "reward.fn='no_such_module_xyz:reward': module 'no_such_module_xyz' not found" in err
    assert len(err.splitlines()) == 1 and not runs.exists()


def test_reward_and_data_keys_round_trip_through_yaml(tmp_path):
    from rhyme_jax.config import to_yaml

    train = _write_jsonl(tmp_path / "t.jsonl", _rows(2))
    cfg = load_config(TINY, _data_overrides(train, train) + ["reward.fn=pkg.mod:Cls.fn", "reward.batched=true",
                                                             "reward.kwargs.n=2", "reward.kwargs.names=[a,b]"])
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(cfg))
    again = load_config(saved)
    assert again == cfg and hash(again) == hash(cfg)
    assert again.reward.kwargs == {"n": 2, "names": ["a", "b"]} and again.data.metadata_fields == ["level", "tag"]
