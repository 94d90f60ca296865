"""Datasets: GSM8K loading (real files + malformed input) and the synthetic arithmetic task."""

import json
import re
from pathlib import Path

import pytest

from rhyme_jax.config import load_config
from rhyme_jax.data import (GSM8K_DIR, DataError, Problem, corpus, gsm8k_path, load_gsm8k, load_problems,
                            make_problems, reward)

GSM8K = GSM8K_DIR  # the copy vendored with the package (rhyme_jax/data/gsm8k_data)
REPO = Path(__file__).resolve().parents[1]


def test_gsm8k_real_files():
    train = load_gsm8k(GSM8K / "train.jsonl")
    test = load_gsm8k(GSM8K / "test.jsonl")
    assert len(train) == 7473 and len(test) == 1319
    first = train[0]
    assert first.id == 0 and first.question.startswith("Natalia sold clips to 48")
    assert first.answer == "72" and first.solution.endswith("#### 72")
    assert [p.id for p in test] == list(range(1319))
    # Every canonical answer is a plain number (commas removed) and matches the solution's tail.
    for p in train + test:
        assert re.fullmatch(r"-?\d+(\.\d+)?", p.answer), p
        assert p.solution.rsplit("####", 1)[1].strip().replace(",", "") == p.answer
    # Some GSM8K answers have thousands separators; they must be canonicalised.
    raw = [json.loads(l)["answer"].rsplit("####", 1)[1].strip() for l in open(GSM8K / "train.jsonl")]
    with_comma = [i for i, a in enumerate(raw) if "," in a]
    assert with_comma, "expected some comma answers in GSM8K train"
    assert train[with_comma[0]].answer == raw[with_comma[0]].replace(",", "")
    # The gold worked solution earns full reward.
    assert all(reward(p.solution, p) == 1.0 for p in train[:200])


@pytest.mark.parametrize(
    "bad_line, needle",
    [
        ('{"question": "q", "answer": "x #### 1"', "invalid JSON"),
        ('{"question": "q"}', "'answer'"),
        ('{"question": "q", "answer": "no marker 5"}', "####"),
        ('{"answer": "a #### 1"}', "'question'"),
        ('[1, 2]', "JSON object"),
        ('{"question": "q", "answer": 5}', "'answer'"),
        ('{"question": "q", "answer": "x ####   "}', "empty final answer"),
    ],
)
def test_gsm8k_bad_lines_name_file_and_line(tmp_path, bad_line, needle):
    good = json.dumps({"question": "What is 1+1?", "answer": "1+1=2\n#### 2"})
    f = tmp_path / "bad.jsonl"
    f.write_text("\n".join([good, "", good, bad_line, good]) + "\n")
    with pytest.raises(DataError) as ei:
        load_gsm8k(f)
    msg = str(ei.value)
    assert f"{f}:4:" in msg and needle in msg


def test_gsm8k_missing_file_and_commas(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_gsm8k(tmp_path / "nope.jsonl")
    f = tmp_path / "ok.jsonl"
    f.write_text(json.dumps({"question": "q", "answer": "so 1000+234\n#### 1,234"}) + "\n")
    assert load_gsm8k(f) == [Problem(0, "q", "so 1000+234\n#### 1,234", "1234")]


_EQ = re.compile(r"^(\d+) ([-+*]) (\d+) = (\d+)$")


def _check_solution(p: Problem, max_number: int) -> int:
    lines = p.solution.split("\n")
    assert lines[-1] == f"#### {p.answer}"
    prev = None
    for line in lines[:-1]:
        m = _EQ.match(line)
        assert m, f"bad step line {line!r}"
        a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
        assert {"+": a + b, "-": a - b, "*": a * b}[op] == c, line
        assert 0 <= c <= 99 and 1 <= b <= max(max_number, 9)
        if prev is not None:
            assert a == prev, "each step continues from the previous result"
        prev = c
    assert str(prev) == p.answer
    return len(lines) - 1


def test_synthetic_solutions_are_correct():
    probs = make_problems(3, "train", 400, min_steps=2, max_steps=4, max_number=20)
    steps = [_check_solution(p, 20) for p in probs]
    assert set(steps) == {2, 3, 4}
    ops = {line.split()[1] for p in probs for line in p.solution.split("\n")[:-1]}
    assert ops == {"+", "-", "*"}
    assert all(reward(p.solution, p) == 1.0 for p in probs)
    assert [p.id for p in probs] == list(range(400))
    assert len({p.question for p in probs}) == 400
    # Varied templates: several verbs appear.
    text = " ".join(p.question for p in probs)
    for verb in ("buys", "gives away", "holds", "times as many"):
        assert verb in text
    # The question states each operand; the answer is not leaked.
    for p in probs[:50]:
        for line in p.solution.split("\n")[:-1]:
            assert re.search(rf"\b{line.split()[2]}\b", p.question) or line.split()[2] in ("2", "3")


def test_synthetic_deterministic_and_disjoint():
    a = make_problems(7, "train", 300)
    assert a == make_problems(7, "train", 300)
    assert a != make_problems(8, "train", 300)
    assert make_problems(7, "train", 100) == a[:100]  # prefix-stable
    ev = make_problems(7, "eval", 300)
    assert not {p.question for p in ev} & {p.question for p in a}
    # Disjoint even against a larger train set and another seed's train split.
    big = {p.question for p in make_problems(7, "train", 3000, min_steps=2, max_steps=2, max_number=5)}
    ev2 = make_problems(7, "eval", 200, min_steps=2, max_steps=2, max_number=5)
    assert not big & {p.question for p in ev2}


def test_synthetic_config_ranges_and_errors():
    for p in make_problems(0, "eval", 100, min_steps=3, max_steps=3, max_number=5):
        assert _check_solution(p, 5) == 3
    with pytest.raises(DataError, match="data.max_steps"):
        make_problems(0, "train", 1, min_steps=4, max_steps=2)
    with pytest.raises(DataError, match="data.max_number"):
        make_problems(0, "train", 1, max_number=1)
    with pytest.raises(DataError, match="split"):
        make_problems(0, "test", 1)


def test_corpus_and_load_problems(tmp_path):
    probs = make_problems(0, "train", 3)
    assert corpus(probs) == [probs[0].question, probs[0].solution, probs[1].question,
                             probs[1].solution, probs[2].question, probs[2].solution]
    cfg = load_config(overrides=["data.num_train=50", "data.num_eval=20", "data.seed=4"])
    train, ev = load_problems(cfg.data)
    assert train == make_problems(4, "train", 50) and ev == make_problems(4, "eval", 20)
    # The config loader (and the DataSection itself) rejects the value up front; load_problems
    # guards its own input too.
    import dataclasses
    from types import SimpleNamespace

    from rhyme_jax.config import ConfigError, DataSection

    with pytest.raises(ConfigError, match="data.source"):
        load_config(overrides=["data.source=parquet"])
    with pytest.raises(ConfigError, match="data.source='parquet'"):
        DataSection(source="parquet")
    with pytest.raises(DataError, match="data.source"):
        load_problems(SimpleNamespace(**{**dataclasses.asdict(DataSection()), "source": "parquet"}))
    with pytest.raises(DataError, match="nope.jsonl: GSM8K file not found"):
        load_problems(load_config(overrides=["data.source=gsm8k", f"data.train_path={tmp_path / 'nope.jsonl'}"]).data)
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n" for i in range(5)))
    cfg = load_config(overrides=["data.source=gsm8k", f"data.train_path={f}", f"data.test_path={f}",
                                 "data.num_eval=3"])
    train, ev = load_problems(cfg.data)
    assert len(train) == 5 and [p.answer for p in ev] == ["0", "1", "2"]


def test_gsm8k_vendored_by_default_from_any_directory(tmp_path, monkeypatch):
    """Empty ``data.train_path`` / ``test_path`` (the recipes') mean the vendored copy, whatever the
    working directory; the copy keeps its MIT notice and ships as package data."""
    assert gsm8k_path("train") == GSM8K_DIR / "train.jsonl" and gsm8k_path("test", "x.jsonl") == Path("x.jsonl")
    with pytest.raises(DataError, match="split"):
        gsm8k_path("eval")
    assert "MIT License" in (GSM8K_DIR / "LICENSE").read_text()
    assert "openai/grade-school-math" in (GSM8K_DIR / "README.md").read_text()
    assert '"gsm8k_data/*.jsonl"' in (REPO / "pyproject.toml").read_text()
    monkeypatch.chdir(tmp_path)
    for recipe in ("gsm8k_smollm2_135m.yaml", "gsm8k_qwen2.5_1.5b.yaml"):
        cfg = load_config(REPO / "configs" / recipe, overrides=["data.num_eval=4"])
        assert cfg.data.source == "gsm8k" and not cfg.data.train_path and not cfg.data.test_path
        train, ev = load_problems(cfg.data)
        assert len(train) == 7473 and train[0].answer == "72"
        assert [p.id for p in ev] == [0, 1, 2, 3] and ev[0].question.startswith("Janet")


def test_no_file_reads_data_outside_the_repo():
    """A fresh clone stands alone: no code, config, test or doc names a dataset or file of the
    workspace around the checkout (the GSM8K files are vendored)."""
    needles = ["../" + "shared", "/work" + "/", "shared/" + "datasets", "shared/" + "design"]
    files = [p for d in ("rhyme_jax", "pallas_kernels", "tests", "benchmarks", "configs", "docs")
             for p in (REPO / d).rglob("*") if p.suffix in (".py", ".yaml", ".md", ".sh", ".toml")]
    files += [REPO / "pyproject.toml", REPO / "README.md"]
    hits = [f"{p.relative_to(REPO)}:{i}: {line.strip()}" for p in files if p.is_file()
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if any(n in line for n in needles)]
    assert not hits, "\n".join(hits)
