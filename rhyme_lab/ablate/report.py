"""``table.md`` and ``results.csv`` of a suite: our figure beside the paper's for every id."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from rhyme_lab.ablate.registry import ABLATIONS
from rhyme_jax.io.atomic import atomic_write

CSV_FIELDS = ("id", "status", "metric", "variant", "value", "spread", "n", "paper")


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return " ".join(str(text).split()).replace("|", "/")


def table_md(suite: str, results: dict[str, dict], meta: dict, plots: list[Path]) -> str:
    """The markdown report: a header with the run's setting, one row per id, each id's
    ``details`` (multi-line markdown, e.g. L1's per-epoch tables), the plots."""
    lines = [f"# Paper ablations: rhyme-jax beside RhymeRL (suite `{suite}`, scale `{meta['scale']}`)", "",
             " | ".join(f"{k}: {v}" for k, v in meta.items()), "",
             "Ours: CPU scale (the demo model on 4 rollout workers over fake CPU devices, and "
             "SmolLM2-135M-Instruct rollouts); paper: Qwen 8B-32B on GPU clusters (arXiv 2508.18588 s.6). "
             "Ratios compare like with like inside one table row; see docs/reproduction.md for the setup "
             "differences and the real-scale commands.", "",
             "| id | varied | measured | ours | paper | setup / notes |", "|---|---|---|---|---|---|"]
    for aid, r in results.items():
        a = ABLATIONS[aid]
        ours = r["ours"] if r["status"] == "ok" else f"n/a: {r['reason']}"
        lines.append(f"| {aid} | {_cell(a.varied)} | {_cell(a.measured)} | {_cell(ours)} | {_cell(a.paper)} | "
                     f"{_cell(r.get('notes', ''))} |")
    for aid, r in results.items():  # per-epoch tables and the like (multi-line markdown)
        if r["status"] == "ok" and r.get("details"):
            lines += ["", f"## {aid}: {ABLATIONS[aid].varied}", "", r["details"]]
    if plots:
        lines += ["", "Plots: " + ", ".join(f"[{p.name}]({p.name})" for p in plots)]
    return "\n".join(lines) + "\n"


def results_csv(results: dict[str, dict]) -> str:
    """One row per figure (``measures.figure``); an n/a id is one row carrying its reason."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    for aid, r in results.items():
        paper = ABLATIONS[aid].paper
        if r["status"] != "ok":
            w.writerow({"id": aid, "status": "n/a", "metric": r["reason"], "paper": paper})
            continue
        for f in r["figures"]:
            w.writerow({"id": aid, "status": "ok", "metric": f["metric"], "variant": f["variant"],
                        "value": "" if f["value"] is None else f"{f['value']:.6g}",
                        "spread": "" if f.get("spread") is None else f"{f['spread']:.6g}",
                        "n": f.get("n", 1), "paper": paper})
    return buf.getvalue()


def write_report(out: Path, suite: str, results: dict[str, dict], meta: dict, plots: list[Path]) -> Path:
    """Write ``out/table.md`` and ``out/results.csv`` atomically; returns the table's path."""
    out = Path(out)
    with atomic_write(out / "table.md", "w") as fh:
        fh.write(table_md(suite, results, meta, plots))
    with atomic_write(out / "results.csv", "w") as fh:
        fh.write(results_csv(results))
    return out / "table.md"
