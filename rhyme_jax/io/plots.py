"""Run summary figure: GRPO reward curve, held-out accuracy and response length.

Uses matplotlib's object API with the Agg canvas directly (no pyplot, no global backend change),
so it works headless and from any thread.
"""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from rhyme_jax.io.metrics import read_metrics

PLOT_FILE = "reward_accuracy.png"
# Accepted metric names, first present wins (the trainer's names come first).
REWARD_KEYS = ("reward/mean", "reward_mean", "mean_reward", "reward")
ACCURACY_KEYS = ("eval/accuracy", "accuracy")
LENGTH_KEYS = ("response_length/mean", "response_len/mean", "response_length", "mean_response_length",
               "length/mean")


def _series(rows: list[dict], phase: str, keys: tuple[str, ...]) -> tuple[str | None, list[int], list[float]]:
    """(key used, steps, values) of the first key in ``keys`` present in rows of ``phase``."""
    for key in keys:
        pts = [(int(r["step"]), r[key]) for r in rows
               if r.get("phase") == phase and isinstance(r.get(key), (int, float))
               and math.isfinite(r[key])]
        if pts:
            pts.sort()
            return key, [s for s, _ in pts], [float(v) for _, v in pts]
    return None, [], []


def _panel(ax, title: str, ylabel: str, key, xs, ys, marker: str = "") -> None:
    ax.set_title(title)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if key is None:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    else:
        ax.plot(xs, ys, marker=marker or None, label=key)
        ax.legend(loc="best", fontsize="small")


def plot_run(run_dir: str | Path) -> Path:
    """Write ``<run_dir>/reward_accuracy.png`` from ``<run_dir>/metrics.jsonl`` and return its path.

    Panels: (1) mean reward per GRPO step (phase ``"train"``, first of ``REWARD_KEYS``);
    (2) held-out accuracy at eval points (phase ``"eval"``, ``"eval/accuracy"``); (3) mean response
    length in tokens (phase ``"train"``, first of ``LENGTH_KEYS``), only if logged. Missing metrics
    or an absent metrics file give "no data" panels rather than an error.
    """
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    reward = _series(rows, "train", REWARD_KEYS)
    acc = _series(rows, "eval", ACCURACY_KEYS)
    length = _series(rows, "train", LENGTH_KEYS)
    n = 3 if length[0] is not None else 2
    fig = Figure(figsize=(5 * n, 4), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, n)
    _panel(axes[0], "Mean reward (train)", "reward", *reward)
    _panel(axes[1], "Held-out accuracy", "accuracy", *acc, marker="o")
    if acc[0] is not None:
        axes[1].set_ylim(-0.02, 1.02)
    if n == 3:
        _panel(axes[2], "Mean response length", "tokens", *length)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = run_dir / PLOT_FILE
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{PLOT_FILE}.tmp")
    fig.savefig(tmp, format="png")
    tmp.replace(out)
    return out
