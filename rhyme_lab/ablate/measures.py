"""Each ablation id's figures from the units' outputs (``units/<unit>.json``).

``measure(id, inputs)`` returns the id's result: ``status`` (``ok`` or ``n/a`` with a
``reason``), ``ours`` (the table cell), ``figures`` (one row per number for results.csv:
metric, variant, value, spread, n) and ``notes``. End-to-end figures leave out each run's first
``skip`` steps (the update compiles in step 1); their spread is the standard deviation over the
steps of the per-step ratio (the runs see the same prompts at each step). HistoSpec knobs are
replayed (``replay.py``) over every (history, target) choice of the session's plain epochs at its
first temperature; their spread is the standard deviation over those choices.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


class MissingInput(RuntimeError):
    """A unit an id needs has no output (failed or not run); the message says which and why."""


class Inputs:
    """The units' results of one results directory, read on first use."""

    def __init__(self, out: Path, failures: dict[str, str] | None = None):
        self.out, self.failures = Path(out), dict(failures or {})
        self._cache: dict[str, dict] = {}
        self._replays: dict = {}

    def unit(self, name: str) -> dict:
        """The ``result`` of unit ``name``. Raises ``MissingInput`` when it has none."""
        if name not in self._cache:
            path = self.out / "units" / f"{name}.json"
            if not path.is_file():
                why = self.failures.get(name, "not run")
                raise MissingInput(f"unit {name} has no result ({why})")
            self._cache[name] = json.loads(path.read_text())["result"]
        return self._cache[name]


def figure(metric: str, variant: str, value, spread=None, n: int = 1) -> dict:
    """One results.csv row of an id."""
    return {"metric": metric, "variant": variant, "value": value, "spread": spread, "n": n}


def _mean_std(xs) -> tuple[float, float | None]:
    a = np.asarray([x for x in xs if x is not None and np.isfinite(x)], np.float64)
    if not a.size:
        return float("nan"), None
    return float(a.mean()), (float(a.std(ddof=1)) if a.size > 1 else None)


def pm(value: float, spread: float | None, fmt: str = "{:.2f}") -> str:
    """``value ± spread`` (the spread left out when there is none)."""
    return fmt.format(value) + (f" ± {fmt.format(spread)}" if spread is not None else "")


def ratio_of_sums(num, den) -> tuple[float, float | None]:
    """``sum(num) / sum(den)`` over paired samples (e.g. one step's oracle and drafter seconds)
    and its standard error by the delta method, ``sqrt(sum(d_k^2) / (n (n - 1))) / mean(den)``
    with ``d_k = num_k - R den_k`` (Cochran, *Sampling Techniques*, 3rd ed., s. 6.4); the error is
    None below 2 samples.

    Raises:
      ValueError: ``num`` and ``den`` of different lengths, none, or ``sum(den) <= 0``.
    """
    a, b = np.asarray(num, np.float64), np.asarray(den, np.float64)
    if a.shape != b.shape or a.ndim != 1 or not a.size or b.sum() <= 0:
        raise ValueError(f"num/den: expected two equal 1-D samples with sum(den) > 0, got {a.shape} / {b.shape}")
    r = float(a.sum() / b.sum())
    if a.size < 2:
        return r, None
    d = a - r * b
    return r, float(np.sqrt((d @ d) / (a.size * (a.size - 1))) / b.mean())


# ------------------------------------------------------------------------ end-to-end runs (demo)
def timed_steps(r: dict) -> list[dict]:
    """A GRPO unit's steps after its first ``skip`` (all of them if none would be left)."""
    return [s for s in r["steps"] if s["step"] > r.get("skip", 1)] or r["steps"]


def e2e_summary(r: dict) -> dict:
    """Totals of an end-to-end unit over its timed steps: tokens/s (generated tokens / step wall
    seconds), rollout-only tokens/s (over the rollouts' seconds) and the rollout share of the step
    time, mean step / rollout / update seconds, mean bubble fraction and migrated share, HistoSpec
    acceptance, compiles inside the timed steps."""
    st = timed_steps(r)
    tokens = sum(s.get("rollout/generated_tokens", 0.0) for s in st)
    wall = sum(s["wall_s"] for s in st)
    drafted = sum(s.get("spec/drafted_tokens", 0.0) for s in st)
    mean = lambda k: float(np.mean([s.get(k, 0.0) for s in st]))  # noqa: E731
    roll = sum(s.get("time/rollout_s", 0.0) for s in st)
    return {"first": st[0]["step"], "last": st[-1]["step"], "steps": len(st), "tokens": tokens,
            "tokens_per_s": tokens / max(wall, 1e-9), "rollout_tokens_per_s": tokens / max(roll, 1e-9),
            "rollout_share": roll / max(wall, 1e-9), "step_s": wall / len(st), "rollout_s": mean("time/rollout_s"),
            "train_s": mean("time/train_s"), "bubble": mean("sched/bubble_fraction"),
            "migrated": mean("sched/migrated_share"), "compiles": int(sum(s["compiles"] for s in st)),
            "acceptance": sum(s.get("spec/accepted_tokens", 0.0) for s in st) / drafted if drafted else None}


def step_ratio(a: dict, b: dict) -> tuple[float, float | None]:
    """Throughput of run ``b`` over run ``a``: the ratio of totals, and the standard deviation of
    the per-step ratios (steps matched by number)."""
    sa, sb = e2e_summary(a), e2e_summary(b)
    tps = lambda s: s.get("rollout/generated_tokens", 0.0) / max(s["wall_s"], 1e-9)  # noqa: E731
    by = {s["step"]: tps(s) for s in timed_steps(a)}
    per = [tps(s) / by[s["step"]] for s in timed_steps(b) if by.get(s["step"])]
    return sb["tokens_per_s"] / max(sa["tokens_per_s"], 1e-9), _mean_std(per)[1]


def _e2e_ratio(inp: Inputs, base: str, new: str, label: str) -> tuple[str, str, list[dict]]:
    """``("R ± sd", "(tok/s vs tok/s end to end, steps; rollouts alone Q)", figures)``."""
    a, b = inp.unit(base), inp.unit(new)
    ratio, spread = step_ratio(a, b)
    sa, sb = e2e_summary(a), e2e_summary(b)
    roll = sb["rollout_tokens_per_s"] / max(sa["rollout_tokens_per_s"], 1e-9)
    detail = (f"({sb['tokens_per_s']:.0f} vs {sa['tokens_per_s']:.0f} tok/s end to end, steps "
              f"{sa['first']}-{sa['last']}; rollouts alone {roll:.2f}x)")
    return pm(ratio, spread), detail, [figure("end-to-end throughput ratio", label, ratio, spread, sa["steps"]),
                  figure("rollout-only throughput ratio", label, roll, n=sa["steps"]),
                  figure("end-to-end tokens/s", base, sa["tokens_per_s"], n=sa["steps"]),
                  figure("end-to-end tokens/s", new, sb["tokens_per_s"], n=sb["steps"])]


def _e2e_note(inp: Inputs, *units: str) -> str:
    parts = []
    for u in units:
        s, r = e2e_summary(inp.unit(u)), inp.unit(u)
        parts.append(f"{u}: step {s['step_s']:.1f} s (rollout {s['rollout_s']:.1f} = {s['rollout_share']:.0%}, "
                     f"update {s['train_s']:.1f}), bubble {s['bubble']:.0%}, migrated {s['migrated']:.1%}, "
                     f"{r['workers']} workers, {r['rows_per_step']} rows/step" +
                     (f", {s['compiles']} compiles in timed steps" if s["compiles"] else ""))
    return "; ".join(parts)


def a1(inp: Inputs) -> dict:
    head, detail, figs = _e2e_ratio(inp, "e2e_fifo", "e2e_tier1_migration", "tier1+migration / fifo")
    return {"ours": f"{head}x {detail}", "figures": figs,
            "notes": _e2e_note(inp, "e2e_fifo", "e2e_tier1_migration")}


def a2(inp: Inputs) -> dict:
    head, detail, figs = _e2e_ratio(inp, "e2e_tier1_migration", "e2e_tier12_migration",
                                    "tier1+tier2+migration / tier1+migration")
    total, _ = step_ratio(inp.unit("e2e_fifo"), inp.unit("e2e_tier12_migration"))
    figs.append(figure("end-to-end throughput ratio", "tier1+tier2+migration / fifo", total))
    return {"ours": f"x{head} more {detail}; {total:.2f}x vs fifo", "figures": figs,
            "notes": _e2e_note(inp, "e2e_tier12_migration")}


def a3(inp: Inputs) -> dict:
    head, detail, figs = _e2e_ratio(inp, "e2e_tier12_migration", "e2e_histospec", "+HistoSpec / HistoPipe")
    total, _ = step_ratio(inp.unit("e2e_fifo"), inp.unit("e2e_histospec"))
    figs.append(figure("end-to-end throughput ratio", "HistoPipe+HistoSpec / fifo", total))
    acc = e2e_summary(inp.unit("e2e_histospec"))["acceptance"]
    return {"ours": f"x{head} more {detail}; {total:.2f}x vs fifo", "figures": figs,
            "notes": (f"acceptance {acc:.2f}; " if acc is not None else "") + _e2e_note(inp, "e2e_histospec")}


def a6(inp: Inputs) -> dict:
    a, b = inp.unit("e2e_fifo"), inp.unit("e2e_tier12_migration")
    sa, sb = e2e_summary(a), e2e_summary(b)
    speed = sa["step_s"] / max(sb["step_s"], 1e-9)
    mig = [s.get("sched/migrated_share", 0.0) for s in timed_steps(b)]
    m, m_sd = _mean_std(mig)
    figs = [figure("time per 10 steps (s)", "fifo", 10 * sa["step_s"], n=sa["steps"]),
            figure("time per 10 steps (s)", "HistoPipe", 10 * sb["step_s"], n=sb["steps"]),
            figure("speed-up per 10 steps", "HistoPipe / fifo", speed), figure("migrated share", "HistoPipe", m, m_sd,
                                                                               len(mig))]
    roll = sa["rollout_s"] / max(sb["rollout_s"], 1e-9)
    figs.append(figure("rollout time ratio", "HistoPipe / fifo", roll, n=sb["steps"]))
    return {"ours": f"{speed:.2f}x ({10 * sb['step_s']:.0f} vs {10 * sa['step_s']:.0f} s per 10 steps; rollouts "
                    f"alone {roll:.2f}x); "
                    f"{pm(100 * m, None if m_sd is None else 100 * m_sd, '{:.1f}')}% migrated",
            "figures": figs, "notes": _e2e_note(inp, "e2e_fifo", "e2e_tier12_migration")}


def a4(inp: Inputs) -> dict:
    r = inp.unit("demo_paired")
    by_epoch: dict[int, list[dict]] = {}
    for s in timed_steps(r):
        by_epoch.setdefault(int(s.get("rollout/epoch", 1)), []).append(s)
    figs, cells = [], []
    for ep, st in sorted(by_epoch.items()):
        tot = {k: {x: sum(s[k][x] for s in st) for x in st[0][k]} for k in ("plain", "spec")}
        speed = (tot["spec"]["generated_tokens"] / max(tot["spec"]["seconds"], 1e-9)) / \
            max(tot["plain"]["generated_tokens"] / max(tot["plain"]["seconds"], 1e-9), 1e-9)
        per = [(s["spec"]["generated_tokens"] / max(s["spec"]["seconds"], 1e-9))
               / max(s["plain"]["generated_tokens"] / max(s["plain"]["seconds"], 1e-9), 1e-9) for s in st]
        acc = tot["spec"]["accepted_tokens"] / max(tot["spec"]["drafted_tokens"], 1.0)
        passes = tot["plain"]["forward_passes"] / max(tot["spec"]["forward_passes"], 1.0)
        figs += [figure("rollout speed-up (tokens/s)", f"epoch {ep}", speed, _mean_std(per)[1], len(st)),
                 figure("acceptance", f"epoch {ep}", acc, n=len(st)),
                 figure("fewer batch passes", f"epoch {ep}", passes, n=len(st))]
        drafted = tot["spec"]["drafted_tokens"]
        cells.append(f"epoch {ep}: {speed:.2f}x, " + (f"acc {acc:.2f}, {passes:.2f}x fewer passes" if drafted
                                                       else "nothing drafted" + (" (no history yet)" if ep == 1 else "")))
    return {"ours": "; ".join(cells), "figures": figs,
            "notes": f"demo model, 1 worker, {r['rows_per_step']} rows/step, plain and HistoSpec on the same "
                     f"weights/prompts/key each step, taking turns going first; epoch 1 has no history, so both "
                     f"rollouts do the same work there: its ratio is the timing noise of this machine"}
