"""The suite's figures (matplotlib's object API on the Agg canvas, written atomically).

* ``speedup_bars.png``: every speed-up / throughput ratio of the ids, the paper's figure beside
  it where the paper gives one;
* ``acceptance_per_step.png``: HistoSpec acceptance and rollout speed-up per GRPO step (A4's
  paired run, A3's run), with the paper's 65-79% band;
* ``draft_lengths.png``: draft-length histograms of the replayed drafters (K2 windows, K4);
* ``gantt_<unit>.png``: rollout workers' busy intervals per step of the end-to-end runs
  (``sched.timeline.plot_gantt``);
* ``learning_<id>.png`` (L1, L2): HistoSpec's rollout speed-up and the oracle bound against epoch
  and against entropy, beside the plain run's reward curve.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from rhyme_jax.io.atomic import atomic_write

# the paper's figure for (id, variant ending): up to / typical values of s.6
PAPER_SPEEDUP = {("A1", "/ fifo"): 1.43, ("A2", "/ fifo"): 1.56, ("A2", "/ tier1+migration"): 1.10,
                 ("A3", "/ fifo"): 2.34, ("A3", "/ HistoPipe"): 1.50, ("A4", ""): 1.86, ("A5", ""): 1.83,
                 ("A6", "/ fifo"): 1.68}
SPEEDUP_METRICS = ("end-to-end throughput ratio", "rollout speed-up (tokens/s)", "speed-up per 10 steps",
                   "live rollout speed-up (tokens/s)")
GANTT_UNITS = ("e2e_fifo", "e2e_tier12_migration", "e2e_histospec")


def _figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h))
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> Path:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    with atomic_write(path, "wb") as fh:
        fh.write(buf.getvalue())
    return path


def paper_speedup(aid: str, variant: str) -> float | None:
    """The paper's speed-up for an id's figure variant (``PAPER_SPEEDUP``), or None."""
    return next((v for (a, end), v in PAPER_SPEEDUP.items() if a == aid and variant.endswith(end)), None)


def speedup_bars(results: dict[str, dict], path: Path) -> Path | None:
    """Bars of every speed-up figure (value 1 = no gain), paper markers where numeric."""
    bars = [(f"{aid} {f['variant']}", f["value"], paper_speedup(aid, f["variant"])) for aid, r in results.items()
            if r["status"] == "ok" for f in r["figures"] if f["metric"] in SPEEDUP_METRICS and f["value"] is not None]
    if not bars:
        return None
    fig = _figure(max(6.0, 0.45 * len(bars) + 2), 4.5)
    ax = fig.add_subplot(1, 1, 1)
    x = np.arange(len(bars))
    ax.bar(x, [b[1] for b in bars], color="tab:blue", label="ours")
    px = [(i, b[2]) for i, b in enumerate(bars) if b[2] is not None]
    if px:
        ax.scatter([i for i, _ in px], [v for _, v in px], color="tab:red", marker="_", s=300, label="paper (up to)")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(x)
    ax.set_xticklabels([b[0] for b in bars], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("ratio (> 1 = faster)")
    ax.set_title("Speed-ups: ours (CPU scale) and the paper's")
    ax.legend(fontsize="small")
    return _save(fig, path)


def acceptance_per_step(units: dict[str, dict], path: Path) -> Path | None:
    """Acceptance (left) and rollout speed-up (right, paired run) per GRPO step."""
    series = []
    for name in ("demo_paired", "e2e_histospec"):
        r = units.get(name)
        if r:
            st = [s for s in r["steps"] if s.get("spec/drafted_tokens", 0) > 0]
            series.append((name, [s["step"] for s in st], [s["spec/acceptance_rate"] for s in st]))
    paired = units.get("demo_paired")
    if not any(s[1] for s in series):
        return None
    fig = _figure(11, 4)
    ax = fig.add_subplot(1, 2, 1)
    for name, xs, ys in series:
        ax.plot(xs, ys, marker="o", label=name)
    ax.axhspan(0.65, 0.79, color="tab:green", alpha=0.2, label="paper 65-79%")
    ax.set(xlabel="GRPO step", ylabel="acceptance (accepted / drafted)", ylim=(0, 1), title="HistoSpec acceptance")
    ax.legend(fontsize="small")
    ax2 = fig.add_subplot(1, 2, 2)
    if paired:
        st = [s for s in paired["steps"] if s["plain"]["seconds"] > 0 and s["spec"]["seconds"] > 0]
        ratio = [(s["spec"]["generated_tokens"] / s["spec"]["seconds"]) / max(
            s["plain"]["generated_tokens"] / s["plain"]["seconds"], 1e-9) for s in st]
        ax2.plot([s["step"] for s in st], ratio, marker="o", label="HistoSpec / plain tokens/s")
        ax2.plot([s["step"] for s in st], [s["plain"]["forward_passes"] / max(s["spec"]["forward_passes"], 1)
                                           for s in st], marker="s", label="fewer batch passes")
    ax2.axhline(1.0, color="gray", lw=0.8)
    ax2.set(xlabel="GRPO step", ylabel="ratio", title="A4: paired rollouts per step")
    ax2.legend(fontsize="small")
    return _save(fig, path)


def draft_lengths(results: dict[str, dict], path: Path) -> Path | None:
    """Histograms of non-empty draft lengths of the replayed drafters (K2 windows, K4)."""
    hists = [(f"{aid} {name}", np.asarray(h, np.float64)) for aid in ("K2", "K4")
             if results.get(aid, {}).get("status") == "ok" for name, h in results[aid].get("hists", {}).items()]
    hists = [(n, h) for n, h in hists if h[1:].sum() > 0]
    if not hists:
        return None
    fig = _figure(8, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    top = max(int(np.flatnonzero(h)[-1]) for _, h in hists) + 1
    lens = np.arange(1, top + 1)
    for name, h in hists:
        ax.plot(lens, h[1:top + 1] / h[1:].sum(), marker=".", label=name)
    ax.set(xlabel="draft length (tokens, after the engine's cut)", ylabel="share of drafted passes",
           title="Draft lengths of the replayed drafters")
    ax.legend(fontsize="x-small")
    return _save(fig, path)


def gantt(units: dict[str, dict], out: Path) -> list[Path]:
    """``gantt_<unit>.png`` of the end-to-end runs that saved schedules."""
    from rhyme_jax.sched.timeline import load_schedule, plot_gantt

    paths = []
    for name in GANTT_UNITS:
        r = units.get(name)
        sched = load_schedule(r["run_dir"]) if r else {}
        if sched:
            paths.append(plot_gantt(sched, out / f"gantt_{name}.png", num_workers=r["workers"],
                                    title=f"{name}: rollout workers per GRPO step"))
    return paths


def write_plots(out: Path, results: dict[str, dict], units: dict[str, dict]) -> tuple[list, list]:
    """Every plot whose data exists; returns ``(paths, errors)`` (a failing plot is reported,
    not raised)."""
    out = Path(out)
    paths, errors = [], []
    jobs = (("speedup_bars", lambda: speedup_bars(results, out / "speedup_bars.png")),
            ("acceptance_per_step", lambda: acceptance_per_step(units, out / "acceptance_per_step.png")),
            ("draft_lengths", lambda: draft_lengths(results, out / "draft_lengths.png")),
            ("gantt", lambda: gantt(units, out)),
            ("learning", lambda: learning_curves(results, units, out)))
    for name, job in jobs:
        try:
            got = job()
        except Exception as exc:  # a plot must not lose the table
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        paths += got if isinstance(got, list) else [got] if got else []
    return paths, errors


def learning_curves(results: dict[str, dict], units: dict[str, dict], out: Path) -> list[Path]:
    """``learning_<id>.png`` of L1 / L2: speed-up (between runs, and paired where measured) and
    the bounds (modelled; the live oracle's where measured) per epoch, against entropy, and the
    plain run's train reward per step."""
    paths = []
    for aid, plain in (("L1", "learn_plain"), ("L2", "learn_real_plain")):
        r = results.get(aid, {})
        if r.get("status") != "ok" or not r.get("epochs"):
            continue
        fig = _figure(15, 4.2)
        ax, ax2, ax3 = (fig.add_subplot(1, 3, i) for i in (1, 2, 3))
        for (name, rows), color in zip(r["epochs"].items(), ("tab:blue", "tab:green", "tab:red")):
            label = name.rsplit("_", 1)[-1]
            ep = [x["epoch"] for x in rows]
            ax.plot(ep, [x["rollout_ratio"] for x in rows], color=color, marker="o", label=f"{label}: rollout")
            ax.plot(ep, [x["e2e_ratio"] for x in rows], color=color, marker="s", ls=":", label=f"{label}: end to end")
            ent = sorted((x["entropy"], x["rollout_ratio"]) for x in rows if x["entropy"] is not None)
            ax2.plot([e for e, _ in ent], [v for _, v in ent], color=color, marker="o", label=f"{label}: rollout")
            paired = [(x["epoch"], x["entropy"], x["paired_rollout"]) for x in rows if x.get("paired_rollout")]
            if paired:  # the same steps decoded both ways back to back: free of the drift between runs
                ax.plot([p[0] for p in paired], [p[2] for p in paired], color=color, marker="D", lw=2,
                        label=f"{label}: rollout, paired")
                ent = sorted((p[1], p[2]) for p in paired if p[1] is not None)
                ax2.plot([e for e, _ in ent], [v for _, v in ent], color=color, marker="D", lw=2,
                         label=f"{label}: rollout, paired")
        first, last = next(iter(r["epochs"].values())), list(r["epochs"].values())[-1]
        for key, style, text, rows in (
                ("bound", "--", "modelled bound, siblings' whole responses", first),
                ("bound_history_self", "-.", "modelled bound, history + own tokens", first),
                ("oracle_rollout", "-", "live oracle drafter, paired (the bound)", last)):
            pts = [(x["epoch"], x["entropy"], x[key]) for x in rows if x.get(key)]
            if pts:
                ax.plot([b[0] for b in pts], [b[2] for b in pts], color="k", ls=style, label=text)
                ent = sorted((b[1], b[2]) for b in pts if b[1] is not None)
                ax2.plot([e for e, _ in ent], [v for _, v in ent], color="k", ls=style, marker="x", label=text)
        for a in (ax, ax2):
            a.axhline(1.0, color="gray", lw=0.8)
            a.legend(fontsize="x-small")
        ax.set(xlabel="epoch of the prompt schedule", ylabel="speed-up vs plain", title=f"{aid}: HistoSpec per epoch")
        ax2.set(xlabel="entropy (nats per sampled token)", ylabel="rollout speed-up", title="against entropy")
        steps = units.get(plain, {}).get("steps", [])
        ax3.plot([s["step"] for s in steps], [s.get("reward/mean", 0.0) for s in steps], marker=".")
        ax3.set(xlabel="GRPO step", ylabel="train reward (mean)", title="reward (every run: the same tokens)")
        paths.append(_save(fig, out / f"learning_{aid}.png"))
    return paths
