"""Reporting of ``python -m benchmarks.kernels`` (``rhyme_lab.bench.kernels``): issue targets, the printed table, ``kernels.json`` / ``kernels.md``.

A row is a dict: ``shape`` (batch, context, page_size, q_len), ``label``, ``impl``, ``status``
(``ok``, ``FAILED(correctness)``, ``ERROR(...)``, ``SKIPPED(...)``, ``n/a ...``) and, when
measured, ``max_abs_err``, ``compile_s``, ``median_s``, ``min_s``, ``max_s``, ``pipelined_s``,
``bytes``, ``gbps``, ``pct_roofline``.
"""

from __future__ import annotations

import json
from pathlib import Path

KEY_BATCH, KEY_CONTEXT = 64, 4096  # the issue's verify/decode ratio point
TARGET_RATIO, TARGET_ROOFLINE = 1.3, 60.0  # issue targets: verify/decode <= 1.3x, decode >= 60% roofline


def summarize(rows: list[dict]) -> dict:
    """Issue targets per (implementation, page size) at the ratio point (batch 64, context 4K;
    the first shape of the sweep when that is not in it): verify (q_len 9) / decode (q_len 1) time
    ratio (target <= 1.3) and decode % of roofline (target >= 60); plus each implementation's best
    decode % of roofline over all shapes."""
    ok = [r for r in rows if r.get("status") == "ok"]
    points = [(r["shape"]["batch"], r["shape"]["context"]) for r in rows]
    point = (KEY_BATCH, KEY_CONTEXT) if (KEY_BATCH, KEY_CONTEXT) in points or not points else points[0]
    out = {}
    for r in ok:
        s = r["shape"]
        if (s["batch"], s["context"], s["q_len"]) != (*point, 1):
            continue
        verify = [v for v in ok if v["impl"] == r["impl"] and v["shape"] == dict(s, q_len=9)]
        entry = dict(decode_ms=1e3 * r["median_s"], decode_pct_roofline=r.get("pct_roofline"))
        if verify:
            entry.update(verify_ms=1e3 * verify[0]["median_s"],
                         verify_over_decode=verify[0]["median_s"] / r["median_s"])
            entry["ratio_ok"] = entry["verify_over_decode"] <= TARGET_RATIO
        if entry["decode_pct_roofline"] is not None:
            entry["roofline_ok"] = entry["decode_pct_roofline"] >= TARGET_ROOFLINE
        out[f"{r['impl']} ps{s['page_size']}"] = entry
    best = {}
    for r in ok:
        if r["shape"]["q_len"] == 1 and r.get("pct_roofline") is not None:
            best[r["impl"]] = max(best.get(r["impl"], 0.0), r["pct_roofline"])
    return dict(ratio_point=dict(batch=point[0], context=point[1]), at_ratio_point=out,
                best_decode_pct_roofline=best,
                targets=dict(verify_over_decode_max=TARGET_RATIO, decode_pct_roofline_min=TARGET_ROOFLINE))


def targets_title(summary: dict) -> str:
    """The targets' heading for ``summarize``'s result (its ratio point and the issue targets)."""
    p = summary["ratio_point"]
    return (f"Targets at batch {p['batch']}, context {p['context']} (verify/decode <= {TARGET_RATIO}, "
            f"decode >= {TARGET_ROOFLINE}% of roofline)")


def fmt_opt(v, spec) -> str:
    """``v`` formatted with ``spec``, or "-" for None."""
    return "-" if v is None else format(v, spec)


def fmt_row(r: dict) -> str:
    """One printed row under ``HEADER`` (milliseconds, GB/s, % of roofline; "-" where unmeasured)."""
    ms = lambda k: fmt_opt(r.get(k) and 1e3 * r[k], ".3f")  # noqa: E731
    return (f"{r['label']:<26} {r['impl']:<30} {r['status'][:34]:<34} {fmt_opt(r.get('max_abs_err'), '.1e'):>8} "
            f"{fmt_opt(r.get('compile_s'), '.1f'):>7} {ms('median_s'):>9} {ms('pipelined_s'):>9} "
            f"{fmt_opt(r.get('gbps'), '.0f'):>7} {fmt_opt(r.get('pct_roofline'), '.1f'):>6}")


HEADER = (f"{'shape':<26} {'impl':<30} {'status':<34} {'max_err':>8} {'comp_s':>7} {'med_ms':>9} "
          f"{'pipe_ms':>9} {'GB/s':>7} {'%roof':>6}")


def markdown(meta: dict, rows: list[dict], summary: dict) -> str:
    """The results as a markdown report (run metadata, targets, full table)."""
    lines = ["# Ragged paged attention kernel benchmark", "",
             f"device `{meta['device_kind']}` ({meta['backend']}), jax {meta['jax']}, roofline "
             f"{meta['hbm_tbps']} TB/s, measured copy {fmt_opt(meta.get('copy_tbps'), '.2f')} TB/s; "
             f"H={meta['heads']} KVH={meta['kv_heads']} hd={meta['head_dim']} {meta['dtype']}; "
             f"median of {meta['iters']} runs after {meta['warmup']} warm-ups; {meta['status']}.", "",
             f"## {targets_title(summary)}", "",
             "| impl | decode ms | verify ms | verify/decode | decode % roofline |", "|---|---|---|---|---|"]
    for name, e in summary["at_ratio_point"].items():
        lines.append(f"| {name} | {fmt_opt(e['decode_ms'], '.3f')} | {fmt_opt(e.get('verify_ms'), '.3f')} | "
                     f"{fmt_opt(e.get('verify_over_decode'), '.2f')} | {fmt_opt(e['decode_pct_roofline'], '.1f')} |")
    lines += ["", "Best decode % of roofline: " + (", ".join(
        f"{k} {v:.1f}" for k, v in summary["best_decode_pct_roofline"].items()) or "-"), "",
        "## All shapes", "", "| shape | impl | status | max abs err | compile s | median ms | "
        "pipelined ms | GB/s | % roofline |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = lambda k: fmt_opt(r.get(k) and 1e3 * r[k], ".3f")  # noqa: E731,B023
        lines.append(f"| {r['label']} | {r['impl']} | {r['status']} | {fmt_opt(r.get('max_abs_err'), '.1e')} | "
                     f"{fmt_opt(r.get('compile_s'), '.1f')} | {ms('median_s')} | {ms('pipelined_s')} | "
                     f"{fmt_opt(r.get('gbps'), '.0f')} | {fmt_opt(r.get('pct_roofline'), '.1f')} |")
    return "\n".join(lines) + "\n"


def write_results(out_dir: Path, meta: dict, rows: list[dict], stem: str = "kernels") -> dict:
    """Write ``<stem>.json`` and ``<stem>.md`` atomically; returns the summary."""
    from rhyme_jax.io.atomic import atomic_write

    summary = summarize(rows)
    with atomic_write(out_dir / f"{stem}.json", "w") as fh:
        json.dump(dict(meta=meta, summary=summary, rows=rows), fh, indent=1)
    with atomic_write(out_dir / f"{stem}.md", "w") as fh:
        fh.write(markdown(meta, rows, summary))
    return summary
