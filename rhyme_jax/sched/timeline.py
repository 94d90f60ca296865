"""HistoPipe timeline: rollout workers' busy intervals, bubble metrics and a Gantt chart.

HistoPipe metrics (RhymeRL, arXiv 2508.18588, s.5): over a step's makespan window
``[min start, max end]`` of its intervals,

* **bubble fraction** = idle worker-time / total worker-time (``W * makespan``);
* **earliest-finisher idle** = idle share of the worker that finishes first,
  ``(window end - its last end) / makespan`` (a worker with no interval counts as finishing at the
  window start: idle 1.0); with cross-step worker queues (``window=``) its last end is that of
  its own step's work, and the time it then spends on the next step's rows or on a training
  update (intervals of kind ``"next step"``, ``"train"``) is not idle;
* per-worker busy seconds (overlapping intervals of one worker are merged, not double counted).

Times are seconds (any common origin; the chart shows them relative to each step's start).
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from typing import Any
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rhyme_jax.io.atomic import atomic_write


NEXT_STEP = "next step"  # kind of an interval spent on the next step's rows (cross-step queues)
TRAIN = "train"  # kind of an interval the worker's devices spent on a training update (cross-step queues)


@dataclass(frozen=True)
class WorkerInterval:
    """One busy interval of a rollout worker.

    Attributes:
      worker: worker index in ``[0, W)``.
      start, end: seconds, ``end >= start``.
      kind: what the worker did (e.g. ``"rollout"``, ``"migrated"`` for rows received by tail
        migration, ``"prefill"``); the chart colours by kind.
      source: for a migrated row, the worker it came from (-1 otherwise).
    """

    worker: int
    start: float
    end: float
    kind: str = "rollout"
    source: int = -1

    def __post_init__(self):
        if not (np.isfinite(self.start) and np.isfinite(self.end)) or self.end < self.start:
            raise ValueError(f"WorkerInterval: need finite start <= end, got [{self.start}, {self.end}]")
        if int(self.worker) != self.worker or self.worker < 0:
            raise ValueError(f"WorkerInterval: worker must be an integer >= 0, got {self.worker!r}")


def _merged_length(spans: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(spans):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def bubble_metrics(intervals: Sequence[WorkerInterval], num_workers: int,
                   window: tuple[float, float] | None = None) -> dict:
    """Bubble metrics of one step's intervals.

    Args:
      intervals: the step's ``WorkerInterval`` records (at least one).
      num_workers: W; workers without an interval count as idle for the whole window.
      window: ``(start, end)`` seconds to measure over instead of ``[min start, max end]``
        (cross-step queues: the step's window of the continuous timeline); intervals are clipped
        to it. The earliest finisher is then the worker whose last interval of kind other than
        ``"next step"`` or ``"train"`` ends first.

    Returns:
      ``{"makespan_s", "bubble_fraction", "earliest_finisher", "earliest_finisher_idle",
      "busy_s": [W floats], "idle_s": [W floats], "finish_s": [W floats relative to the window
      start]}``. With a zero-length window the fractions are 0.

    Raises:
      ValueError: no intervals, or a worker index outside ``[0, num_workers)``.
    """
    if not intervals:
        raise ValueError("bubble_metrics: no intervals")
    W = int(num_workers)
    if any(iv.worker >= W for iv in intervals):
        raise ValueError(f"bubble_metrics: a worker index is >= num_workers={W}")
    if window is None:
        t0, t1 = min(iv.start for iv in intervals), max(iv.end for iv in intervals)
    else:
        t0, t1 = float(window[0]), float(window[1])
        if not t1 >= t0:
            raise ValueError(f"bubble_metrics: window end {t1} < start {t0}")
    makespan = t1 - t0
    spans: list[list[tuple[float, float]]] = [[] for _ in range(W)]
    own: list[list[float]] = [[] for _ in range(W)]
    for iv in intervals:
        a, b = max(iv.start, t0), min(iv.end, t1)
        if b >= a:
            spans[iv.worker].append((a, b))
            if iv.kind not in (NEXT_STEP, TRAIN):
                own[iv.worker].append(b)
    busy = np.array([_merged_length(s) for s in spans])
    finish = np.array([max(e, default=t0) - t0 for e in own])
    first = int(np.argmin(finish))
    if makespan > 0:
        bubble = float(1.0 - busy.sum() / (W * makespan))
        after = _merged_length([(max(a, t0 + finish[first]), b) for a, b in spans[first] if b > t0 + finish[first]])
        ef_idle = float((makespan - finish[first] - after) / makespan)
    else:
        bubble = ef_idle = 0.0
    return {
        "makespan_s": float(makespan),
        "bubble_fraction": bubble,
        "earliest_finisher": first,
        "earliest_finisher_idle": ef_idle,
        "busy_s": busy.tolist(),
        "idle_s": (makespan - busy).tolist(),
        "finish_s": finish.tolist(),
    }


def select_steps(steps: Sequence[int], max_steps: int) -> list[int]:
    """The steps a chart shows: all when there are at most ``max_steps``, else the first
    ``ceil(max_steps / 2)`` and the last ``floor(max_steps / 2)`` (sorted)."""
    steps = sorted(steps)
    if len(steps) <= max_steps:
        return steps
    head = -(-max_steps // 2)
    return steps[:head] + steps[len(steps) - (max_steps - head):]


_COLOURS = {"rollout": "#4C72B0", "batch": "#4C72B0", "migrated": "#DD8452", "prefill": "#55A868",
            "train": "#8172B2", NEXT_STEP: "#A6BDDB"}


def plot_gantt(
    intervals_by_step: Mapping[int, Sequence[WorkerInterval]],
    path: str | Path,
    *,
    num_workers: int | None = None,
    max_steps: int = 8,
    title: str | None = None,
    labels: Mapping[int, str] | None = None,
    same_scale: bool = False,
) -> Path:
    """Gantt chart, one subplot per step (one row per worker, time relative to the step start, the
    step's bubble fraction in the subplot title). Readable for long runs: at most ``max_steps``
    steps are drawn (the first and last ones, see ``select_steps``); the figure title says how many
    were left out. Written atomically as PNG (matplotlib's Agg canvas; no pyplot, no global
    backend change).

    Args:
      intervals_by_step: ``{step: intervals}``.
      path: output ``.png``.
      num_workers: rows per subplot (default: 1 + the largest worker index seen).
      max_steps: most subplots drawn.
      title: figure title prefix.
      labels: subplot titles by key (default ``"step <key>"``), e.g. two placements of one step.
      same_scale: one time axis for every subplot (the longest makespan), to compare placements.

    Returns:
      ``path``.

    Raises:
      ValueError: no steps, or a step without intervals.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if not intervals_by_step:
        raise ValueError("plot_gantt: no steps")
    W = num_workers or 1 + max(iv.worker for ivs in intervals_by_step.values() for iv in ivs)
    shown = select_steps(list(intervals_by_step), max_steps)
    cols = min(4, len(shown))
    rows = -(-len(shown) // cols)
    fig = Figure(figsize=(4.2 * cols, 0.45 * W * rows + 1.2 * rows + 0.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    kinds = set()
    span = max(bubble_metrics(intervals_by_step[k], W)["makespan_s"] for k in shown)
    for ax, step in zip(axes.flat, shown):
        ivs = intervals_by_step[step]
        m = bubble_metrics(ivs, W)
        t0 = min(iv.start for iv in ivs)
        for iv in ivs:
            kinds.add(iv.kind)
            ax.barh(iv.worker, iv.end - iv.start, left=iv.start - t0, height=0.7,
                    color=_COLOURS.get(iv.kind, "#937860"), edgecolor="white", linewidth=0.3)
        ax.set_yticks(range(W))
        ax.set_yticklabels([f"w{w}" for w in range(W)], fontsize=7)
        ax.set_ylim(W - 0.5, -0.5)
        ax.set_xlim(0, max(span if same_scale else m["makespan_s"], 1e-12))
        ax.tick_params(axis="x", labelsize=7)
        name = (labels or {}).get(step, f"step {step}")
        ax.set_title(f"{name}: makespan {m['makespan_s']:.3g} s, bubble {m['bubble_fraction']:.0%}", fontsize=8)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("seconds", fontsize=7)
    left_out = len(intervals_by_step) - len(shown)
    head = title or "rollout workers"
    fig.suptitle(head + (f" ({left_out} middle steps not shown)" if left_out else ""), fontsize=9)
    fig.legend(handles=[Patch(color=_COLOURS.get(k, "#937860"), label=k) for k in sorted(kinds)],
               loc="lower right", fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    path = Path(path)
    with atomic_write(path, "wb") as fh:
        fh.write(buf.getvalue())
    return path


def write_schedule(run_dir: str | Path, step: int, intervals: Sequence[WorkerInterval],
                   group_finish_s: np.ndarray, plan: Any) -> Path:
    """Write ``<run_dir>/schedule/step_<step>.json`` atomically: the step's worker intervals
    (seconds from the step's start), each ranking group's completion time, its workers and rows.
    A replayed step (after a resume) overwrites its file."""
    path = Path(run_dir) / "schedule" / f"step_{int(step):06d}.json"
    row = {"step": int(step), "mode": plan.mode, "ascending": plan.ascending,
           "intervals": [[iv.worker, iv.start, iv.end, iv.kind] for iv in intervals],
           "group_finish_s": [float(x) for x in group_finish_s],
           "group_workers": [int(x) for x in plan.group_workers],
           "worker_rows": [[int(r) for r in rows] for rows in plan.worker_rows]}
    with atomic_write(path, "w") as fh:
        json.dump(row, fh)
    return path


def load_schedule(run_dir: str | Path) -> dict[int, list[WorkerInterval]]:
    """``{step: intervals}`` from every ``<run_dir>/schedule/step_*.json``.

    Raises:
      ValueError: a file is not valid JSON of the ``write_schedule`` layout (names the file).
    """
    out: dict[int, list[WorkerInterval]] = {}
    for path in sorted((Path(run_dir) / "schedule").glob("step_*.json")):
        try:
            row = json.loads(path.read_text())
            out[int(row["step"])] = [WorkerInterval(int(w), float(a), float(b), str(k))
                                     for w, a, b, k in row["intervals"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a schedule file ({exc})") from None
    return out
