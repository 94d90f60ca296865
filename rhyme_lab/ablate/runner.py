"""``python -m rhyme_lab ablate SUITE``: run the units the suite's ids need, then measure and report.

Resumable: a unit whose ``units/<unit>.json`` exists is not run again, an id whose
``ids/<id>.json`` says ``ok`` is not measured again (an ``n/a`` id is retried). Each unit runs in
its own process (``python -m rhyme_lab.ablate.units``) with ``XLA_FLAGS`` giving it its fake CPU
devices; its output goes to ``logs/<unit>.log``; a failed unit leaves the ids that need it
``n/a`` with the log's last line as the reason. Progress: one tqdm bar over the units, one for
the running unit (polled from its progress file), one over the ids.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rhyme_lab.ablate import learning, longtail, measures, seeds, spec_measures
from rhyme_lab.ablate.registry import ROOT, UNITS, AblationError, get_scale, suite_ids, units_of
from rhyme_lab.ablate.units import progress_file, unit_json, write_json
from rhyme_lab import provenance

MEASURES = {"A1": measures.a1, "A2": measures.a2, "A3": measures.a3, "A4": measures.a4, "A5": spec_measures.a5,
            "A6": measures.a6, "A10": spec_measures.a10, "K1": spec_measures.k1, "K2": spec_measures.k2,
            "K3": spec_measures.k3, "K4": spec_measures.k4, "K6": spec_measures.k6, "O5": spec_measures.o5,
            "O6": spec_measures.o6, "L1": learning.l1, "L2": learning.l2, "L3": learning.l3,
            "L4": learning.l4, "L5": longtail.l5, "L6": longtail.l6, "L7": seeds.l7}


def default_out(suite: str, scale: str) -> Path:
    """``results/<suite>`` (full scale) or ``results/<suite>-<scale>``."""
    return Path("results") / (suite if scale == "full" else f"{suite}-{scale}")


def _child_env(devices: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    if devices > 1:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    return env


def _last_line(log: Path) -> str:
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()] if log.is_file() else []
    return lines[-1].strip()[:300] if lines else "no output"


def spawn_unit(name: str, out: Path, scale: str, bar=None, sets: tuple[str, ...] = ()) -> str | None:
    """Run one unit in a child process (``sets``: the user's ``--set`` overrides); returns None
    on success, else the reason it failed."""
    log = out / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    run_dir = out / "runs" / name
    if run_dir.exists():  # a crashed earlier attempt: start clean
        import shutil

        shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "rhyme_lab.ablate.units", name, "--out", str(out), "--scale", scale,
           *(f"--set={s}" for s in sets)]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_child_env(UNITS[name].devices))
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                _poll(progress_file(out, name), bar)
        except BaseException:
            proc.terminate()
            proc.wait()
            raise
    if proc.returncode == 0 and unit_json(out, name).is_file():
        return None
    return f"exit status {proc.returncode}: {_last_line(log)} (log: {log})"


def _poll(path: Path, bar) -> None:
    if bar is None or not path.is_file():
        return
    try:
        p = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    state = (max(int(p["total"]), 1), int(p["done"]), str(p.get("what", ""))[:60])
    if state == getattr(bar, "_last_state", None):
        return
    bar._last_state = state
    bar.total, bar.n = state[0], state[1]
    bar.set_postfix_str(state[2])  # refreshes the bar


def run_units(names: list[str], out: Path, scale: str, progress: bool, sets: tuple[str, ...] = ()) -> dict[str, str]:
    """Run the units not done yet, prerequisites first; returns ``{unit: why it failed}``."""
    from tqdm import tqdm

    failures: dict[str, str] = {}
    with tqdm(total=len(names), desc="units", unit="unit", disable=not progress, position=0) as bar:
        for name in names:
            bar.set_postfix_str(name)
            if unit_json(out, name).is_file():
                bar.update(1)
                continue
            missing = [u for u in UNITS[name].needs if u in failures or not unit_json(out, u).is_file()]
            if missing:
                failures[name] = f"needs {', '.join(missing)}, which failed"
            else:
                with tqdm(total=1, desc=f"  {name}", leave=False, disable=not progress, position=1) as inner:
                    why = spawn_unit(name, out, scale, inner, sets)
                if why:
                    failures[name] = why
                    tqdm.write(f"unit {name} failed: {why}")
            bar.update(1)
    return failures


def measure(aid: str, inputs: measures.Inputs) -> dict:
    """One id's result (``measures`` module docstring); ``n/a`` with the reason on any error."""
    try:
        r = MEASURES[aid](inputs)
    except measures.MissingInput as exc:
        return {"id": aid, "status": "n/a", "reason": str(exc)}
    except Exception as exc:  # a broken measurement must not lose the other ids
        return {"id": aid, "status": "n/a", "reason": f"measurement failed: {type(exc).__name__}: {exc}"}
    return {"id": aid, "status": "ok", "notes": "", **r}


def _suite_meta(out: Path, suite: str, scale: str, sets: tuple[str, ...]) -> dict:
    """``out/suite.json``: refuses a results directory of another scale or other ``--set``
    overrides (its runs would not be the ones asked for)."""
    path = out / "suite.json"
    meta = json.loads(path.read_text()) if path.is_file() else \
        {"suite": suite, "scale": scale, "sets": list(sets), "invocations": []}
    if meta["scale"] != scale or meta.get("sets", []) != list(sets):
        raise AblationError(f"{out} holds runs of scale {meta['scale']!r} with --set {meta.get('sets', [])}; "
                            f"pass another --out for scale {scale!r} with --set {list(sets)}")
    return meta


def run_suite(suite: str, *, scale: str = "full", out: Path | None = None, only: str = "", force: bool = False,
              progress: bool = True, sets: tuple[str, ...] = ()) -> tuple[Path, dict[str, dict]]:
    """Run and report ``suite`` at ``scale`` into ``out``; returns ``(table path, results by id)``
    (every id of the suite: those outside ``only`` as stored by earlier invocations).
    ``sets``: ``[RUN:]KEY=VALUE`` config overrides of every run (or of one kind / one run).

    Raises:
      AblationError: unknown suite / id / scale, or ``out`` holds another scale or other sets.
    """
    from tqdm import tqdm

    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    out = Path(out or default_out(suite, scale)).resolve()
    ids = suite_ids(suite, only)
    get_scale(scale)
    meta = _suite_meta(out, suite, scale, tuple(sets))
    if force:
        for aid in ids:
            (out / "ids" / f"{aid}.json").unlink(missing_ok=True)
    done = {aid: json.loads(p.read_text()) for aid in ids if (p := out / "ids" / f"{aid}.json").is_file()}
    done = {k: v for k, v in done.items() if v.get("status") == "ok"}
    todo = [aid for aid in ids if aid not in done]
    failures = run_units(units_of(todo), out, scale, progress, tuple(sets))
    inputs = measures.Inputs(out, failures)
    for aid in tqdm(todo, desc="ids", disable=not progress):
        done[aid] = measure(aid, inputs)
        write_json(out / "ids" / f"{aid}.json", done[aid])
    results = {aid: done[aid] if aid in done else _stored(out, aid) for aid in suite_ids(suite)}
    table = _report(out, suite, scale, results, inputs, meta, t0, load0)
    return table, results


def _stored(out: Path, aid: str) -> dict:
    """An id outside this invocation's ``--only``: its stored result, or n/a (not run yet)."""
    path = out / "ids" / f"{aid}.json"
    if path.is_file():
        return json.loads(path.read_text())
    return {"id": aid, "status": "n/a", "reason": "not run yet (this results directory ran --only other ids)"}


def _report(out, suite, scale, results, inputs, meta, t0, load0) -> Path:
    from rhyme_lab.ablate.plots import write_plots

    units = {}
    for name in UNITS:
        try:
            units[name] = inputs.unit(name)
        except measures.MissingInput:
            pass
    paths, errors = write_plots(out, results, units)
    wall = time.perf_counter() - t0
    meta["invocations"].append({"wall_s": round(wall, 1), "ids": list(results), "load_avg_start": load0,
                                "load_avg_end": os.getloadavg()[0], "plot_errors": errors})
    write_json(out / "suite.json", meta)
    docs = [json.loads(p.read_text()) for p in sorted((out / "units").glob("*.json"))]
    unit_s = sum(d.get("seconds", 0.0) for d in docs)
    head = {"scale": scale, "commit": provenance.summarize([d.get("commit") for d in docs]),
            "machine": provenance.summarize([d.get("machine") for d in docs]),
            "measured": provenance.summarize([d.get("date") for d in docs]),
            "this invocation": f"{wall / 60:.1f} min", "units in all": f"{unit_s / 60:.1f} min",
            "load average (start/end)": f"{load0:.1f}/{os.getloadavg()[0]:.1f}",
            "reported": time.strftime("%Y-%m-%d")}
    from rhyme_lab.ablate.report import write_report

    return write_report(out, suite, results, head, paths)
