"""The stamp of a measurement: commit, machine, date (rhyme_lab/provenance.py)."""

import subprocess

from rhyme_lab import provenance


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_commit_of_a_checkout_clean_dirty_and_none(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.txt").write_text("one\n")
    _git(repo, "add", "a.txt")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "first")
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                         text=True, check=True).stdout.strip()
    assert provenance.code_commit(repo) == sha
    (repo / "results.json").write_text("{}")  # untracked output: still clean
    assert provenance.code_commit(repo) == sha
    (repo / "a.txt").write_text("two\n")
    assert provenance.code_commit(repo) == f"{sha}+dirty"
    plain = tmp_path / "wheel"
    plain.mkdir()
    assert provenance.code_commit(plain) == "not a git checkout"


def test_summarize_one_value_mixed_and_missing():
    assert provenance.summarize(["abc1234"] * 3) == "abc1234"
    assert provenance.summarize(["abc1234", "abc1234", "def5678"]) == "mixed: abc1234 (2 runs), def5678 (1 run)"
    assert provenance.summarize(["abc1234", None]) == "mixed: abc1234 (1 run), not recorded (1 run)"
    assert provenance.summarize([]) == "not recorded"


def test_stamp_fields():
    s = provenance.stamp("1 x NVIDIA H200")
    assert set(s) == {"commit", "machine", "date"}
    assert s["machine"].endswith(", 1 x NVIDIA H200") and "CPU cores" in s["machine"]
    assert len(s["date"]) == 10 and s["date"][4] == "-"
