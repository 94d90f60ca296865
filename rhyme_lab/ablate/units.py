"""One unit of the ablations in its own process: ``python -m rhyme_lab.ablate.units UNIT --out DIR``.

The runner (``runner.py``) starts one process per unit so that a unit with rollout workers on
fake CPU devices gets ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before JAX starts.
A unit writes, atomically (``rhyme_jax.io.atomic``):

* ``DIR/units/<unit>.json``: ``{"unit", "kind", "scale", "config", "overrides", "seconds",
  "commit", "machine", "date", "result"}`` once it has finished (the stamp: ``rhyme_lab.provenance``;
  its presence means done: the runner never reruns it);
* ``DIR/units/<unit>.progress``: ``{"done", "total", "what"}`` while it runs (the runner's
  progress bar polls it);
* its run directory ``DIR/runs/<unit>/`` (rollouts, schedules, metrics of the trainer).

A unit that needs ``demo_sft`` starts from its params and tokenizer (``run.init_from``,
``model.tokenizer_path``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rhyme_lab.ablate.registry import ROOT, UNITS, Unit, get_scale, unit_config
from rhyme_lab import provenance
from rhyme_jax.io.atomic import atomic_write

UNIT_DIR = "units"
RUNS_DIR = "runs"


def unit_json(out: Path, name: str) -> Path:
    """``out/units/<name>.json``: the finished unit's outputs."""
    return Path(out) / UNIT_DIR / f"{name}.json"


def progress_file(out: Path, name: str) -> Path:
    """``out/units/<name>.progress``: ``{"done", "total", "what"}`` while the unit runs."""
    return Path(out) / UNIT_DIR / f"{name}.progress"


def write_json(path: Path, obj) -> None:
    """``obj`` as JSON at ``path``, atomically (NaN and infinities as null)."""
    with atomic_write(path, "w") as fh:
        json.dump(_finite(obj), fh, indent=1)


def _finite(obj):
    if isinstance(obj, float):
        return obj if obj == obj and abs(obj) != float("inf") else None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if hasattr(obj, "item") and getattr(obj, "ndim", 1) == 0:  # numpy scalars
        return _finite(obj.item())
    if hasattr(obj, "tolist"):
        return _finite(obj.tolist())
    return obj


class Progress:
    """Writes ``{"done", "total", "what"}`` to the unit's progress file (at most 2 per second)."""

    def __init__(self, path: Path):
        self.path, self._last = Path(path), 0.0

    def __call__(self, done: int, total: int, what: str = "") -> None:
        now = time.monotonic()
        if now - self._last < 0.5 and done < total:
            return
        self._last = now
        write_json(self.path, {"done": int(done), "total": int(total), "what": what})


def wiring(unit: Unit, out: Path) -> list[str]:
    """Overrides that place the unit's run under ``out`` and start it from its warm start's params
    and tokenizer (the ``sft`` unit it needs: ``demo_sft``, ``longtail_sft``) when that run trained any (a real model with ``sft.steps=0`` starts from
    ``model.path``)."""
    sets = [f"run.runs_dir={Path(out) / RUNS_DIR}", f"run.name={unit.name}", "run.progress=false"]
    warm = next((n for n in unit.needs if UNITS[n].kind == "sft"), None)
    sft = Path(out) / RUNS_DIR / str(warm)
    if warm and (sft / "sft" / "params").exists():
        sets += [f"run.init_from={sft / 'sft' / 'params'}", f"model.tokenizer_path={sft / 'tokenizer.json'}"]
    return sets


def sets_for(unit: Unit, sets: list[str] | tuple[str, ...]) -> list[str]:
    """The user's ``--set [RUN:]KEY=VALUE`` overrides that apply to ``unit``: those without a
    prefix, and those whose prefix is the unit's kind (``sft``, ``e2e``, ``paired``, ``session``)
    or name, with the prefix removed."""
    out = []
    for item in sets:
        key = item.split("=", 1)[0]
        if ":" not in key:
            out.append(item)
            continue
        prefix, rest = item.split(":", 1)
        if prefix in (unit.kind, unit.name):
            out.append(rest)
    return out


def unit_run_config(unit: Unit, scale_name: str, out: Path, extra: tuple[str, ...] = ()):
    """The unit's ``RunConfig`` at the scale, wired under ``out``, with ``extra`` overrides last:
    ``(cfg, path, overrides)``."""
    from rhyme_jax.config import load_config

    path, sets = unit_config(unit, get_scale(scale_name))
    overrides = [*sets, *wiring(unit, out), *extra]
    return load_config(ROOT / path, overrides), path, overrides


def run_unit(name: str, out: Path, scale_name: str, extra: tuple[str, ...] = ()) -> dict:
    """Run unit ``name`` at ``scale_name`` under ``out`` (``extra``: overrides applied last, e.g.
    one rollout worker where a test has one device) and write its JSON; returns the JSON."""
    from rhyme_jax import compile_cache

    unit = UNITS[name]
    scale = get_scale(scale_name)
    cfg, path, overrides = unit_run_config(unit, scale_name, out, extra)
    compile_cache.enable(cfg.run.compile_cache)  # before anything compiles
    progress = Progress(progress_file(out, name))
    t0 = time.perf_counter()
    if unit.kind == "session":
        from rhyme_lab.ablate.session import run_session

        result = run_session(cfg, scale.session, progress)
    else:
        from rhyme_lab.ablate import e2e

        run = {"sft": e2e.run_sft_unit, "e2e": e2e.run_e2e, "paired": e2e.run_paired, "learn": e2e.run_e2e,
               "learn_paired": e2e.run_paired, "learn_real": e2e.run_e2e,
               "learn_real_paired": e2e.run_paired, "learn_twin": e2e.run_twin_placement}[unit.kind]
        kw = {"oracle": unit.oracle} if unit.oracle else {}
        if unit.twin:
            kw["twin"] = unit.twin
        if unit.held_out:
            kw["held_out"] = True
        result = run(cfg, progress, skip=scale.e2e_steps_skipped, warmup=scale.warmup, **kw)
    doc = {"unit": name, "kind": unit.kind, "scale": scale_name, "config": path, "overrides": overrides,
           "seconds": time.perf_counter() - t0, **provenance.stamp(_accelerator()), "result": result}
    write_json(unit_json(out, name), doc)
    progress_file(out, name).unlink(missing_ok=True)
    return doc


def _accelerator() -> str | None:
    """``"<n> x <device kind>"`` of JAX's default backend when it is not the CPU, else None."""
    import jax

    devs = jax.devices()
    return None if devs[0].platform == "cpu" else f"{len(devs)} x {devs[0].device_kind}"


def main(argv=None) -> int:
    """Process entry point (``python -m rhyme_lab.ablate.units``); returns the exit status."""
    ap = argparse.ArgumentParser(description="run one ablation unit (started by `python -m rhyme_lab ablate`)")
    ap.add_argument("unit", choices=sorted(UNITS))
    ap.add_argument("--out", required=True, help="results directory of the suite")
    ap.add_argument("--scale", default="full")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="[RUN:]KEY=VALUE")
    args = ap.parse_args(argv)
    run_unit(args.unit, Path(args.out), args.scale, tuple(sets_for(UNITS[args.unit], args.sets)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
