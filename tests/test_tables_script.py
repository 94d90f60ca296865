"""benchmarks/tables.sh: the one-commit rerun of the CPU tables, one cheap step of it run for real."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tables_script_runs_a_named_step_and_stamps_the_commit(tmp_path):
    env = {**os.environ, "STEPS": "compile_demo", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    subprocess.run(["bash", str(ROOT / "benchmarks" / "tables.sh"), str(tmp_path)], cwd=ROOT, env=env, check=True,
                   timeout=600)
    progress = (tmp_path / "bench" / "progress").read_text().splitlines()
    assert progress[0].startswith("commit {'commit': ")
    assert [line.split(" ", 1)[1] for line in progress[1:]] == ["start compile_demo", "done compile_demo rc=0",
                                                                 "all done"]
    log = (tmp_path / "bench" / "compile_demo.log").read_text()
    assert "verify" in log
    if Path("/usr/bin/time").exists():
        assert "Maximum resident set size" in log  # GNU time around the step
