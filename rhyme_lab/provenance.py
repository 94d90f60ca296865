"""Where a measurement was made: the code's commit, the machine, the date.

Every results file that carries a figure says which code and which machine produced it, so that
a table built from several runs can tell whether they all ran at one commit (the issue "speed
where training really happens", scope 5: tables stamped with their commit, machine and date).
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections import Counter
from pathlib import Path

NOT_RECORDED = "not recorded"
_REPO = Path(__file__).resolve().parents[1]  # the checkout that holds the lab (and the rhyme_jax package)


def code_commit(repo: Path | None = None) -> str:
    """Short commit of the checkout that holds the running ``rhyme_jax`` package, with ``+dirty``
    when tracked files differ from it (untracked files are ignored: results directories live in
    the checkout). ``"not a git checkout"`` for an installed wheel or when git is missing."""
    repo = Path(repo or _REPO)
    try:
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "not a git checkout"
    return f"{sha}+dirty" if dirty else sha


def cpu_model() -> str:
    """The host CPU's model name (``/proc/cpuinfo``), else ``platform.processor()``, else the
    machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(accelerator: str | None = None) -> str:
    """``"<n> CPU cores (<model>)"``, and ``", <accelerator>"`` when one is given (e.g. ``"1 x
    NVIDIA H200"``)."""
    host = f"{os.cpu_count()} CPU cores ({cpu_model()})"
    return f"{host}, {accelerator}" if accelerator else host


def stamp(accelerator: str | None = None) -> dict[str, str]:
    """``{"commit", "machine", "date"}`` of a measurement made now (date as ``YYYY-MM-DD``, UTC)."""
    return {"commit": code_commit(), "machine": machine(accelerator),
            "date": time.strftime("%Y-%m-%d", time.gmtime())}


def summarize(values: list[str | None]) -> str:
    """One header cell for the stamps of several runs: the value when they all agree, else
    ``"mixed: a (3 runs), b (1 run)"``, most common first; a missing stamp counts as
    ``"not recorded"``. An empty list gives ``"not recorded"``."""
    counts = Counter(v or NOT_RECORDED for v in values)
    if not counts:
        return NOT_RECORDED
    if len(counts) == 1:
        return next(iter(counts))
    parts = [f"{v} ({n} run{'s' if n > 1 else ''})" for v, n in counts.most_common()]
    return "mixed: " + ", ".join(parts)
