"""Paired learning units pooled over repeats (``python -m benchmarks.paired_pool``).

The learning suite's paired units decode every step's rollout two or three times back to back on
the same weights, prompts and key, taking turns going first (``ablate.paired``):
``learn_goodput_paired`` plain and the goodput drafter, ``learn_oracle_paired`` plain, the goodput
drafter and the source-bound oracle. One unit gives 10 steps per epoch on the demo, and a step's
ratio ranges about 0.6-1.2 around its epoch's on a 2-core machine, so repeats of a unit over the
same workload (same seed, same tokens) are pooled step by step: ``pooled`` gives per epoch each
unit's ``learning.paired_epochs`` and those of all their steps together, whose ratios carry their
standard errors over steps (``measures.ratio_of_sums``).

Source: the issue "speed where training really happens" (scope 2: ratios in one run).
"""

from __future__ import annotations

import json
from pathlib import Path

from rhyme_lab.ablate.learning import paired_epochs
from rhyme_lab.ablate.measures import pm


def load_unit(path: str | Path, unit: str) -> dict:
    """The ``result`` of a paired unit's JSON (``path`` itself or ``path/units/<unit>.json``) with
    its ``commit``; ``"oracle"`` says whether its steps hold the own drafter's rollout too.

    Raises:
      ValueError: no such file, unreadable, or steps without ``plain`` and ``spec`` rollouts (not a
        paired unit); the message names the file.
    """
    p = Path(path)
    f = p if p.is_file() else p / "units" / f"{unit}.json"
    try:
        body = json.loads(f.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{f}: unreadable unit ({exc})") from None
    r = body.get("result", {})
    if not r.get("steps") or not all("plain" in s and "spec" in s for s in r["steps"]):
        raise ValueError(f"{f}: not a paired unit (its steps lack 'plain' and 'spec' rollouts)")
    return {**r, "commit": body.get("commit", "?"), "oracle": all("own" in s for s in r["steps"])}


def pooled(units: list[dict]) -> tuple[list[dict], dict[int, dict]]:
    """Per unit and pooled (all units' steps together) ``learning.paired_epochs``, the last
    rollout's host drafting time left out for oracle units (the oracle's search).

    Raises:
      ValueError: oracle units and plain paired units mixed, or no unit.
    """
    kinds = {u["oracle"] for u in units}
    if len(kinds) != 1:
        raise ValueError("oracle units and plain paired units cannot be pooled together" if kinds else "no unit")
    host = not kinds.pop()
    merged = {"skip": max(u.get("skip", 1) for u in units), "steps": [s for u in units for s in u["steps"]]}
    return [paired_epochs(u, host_drafting=host) for u in units], paired_epochs(merged, host_drafting=host)


def table_lines(units: list[dict]) -> list[str]:
    """A markdown table of ``pooled(units)``: per epoch each unit's figure and the pooled one ±
    its standard error (oracle units: goodput's share of the bound, both rollout ratios and
    goodput's end-to-end ratio;
    paired units: the rollout and end-to-end ratios against plain).

    Raises:
      ValueError: as ``pooled``.
    """
    each, pool = pooled(units)
    oracle = units[0]["oracle"]
    head = "| epoch | steps | rollout x per unit | rollout x pooled | end-to-end x pooled |"
    if oracle:
        head = ("| epoch | steps | share per unit | pooled share of the bound | goodput rollout x (pooled) | "
                "oracle rollout x (pooled) | goodput end-to-end x (pooled) |")
    out = [f"{len(units)} units (commits {', '.join(u['commit'] for u in units)})", head,
           "|---" * (head.count("|") - 1) + "|"]
    for ep, row in sorted(pool.items()):
        if oracle:
            per = ", ".join(f"{e[ep]['of_bound']:.0%}" for e in each if ep in e)
            out.append(f"| {ep} | {row['steps']} | {per} | {pm(row['of_bound'], row['of_bound_se'], '{:.1%}')} | "
                       f"{pm(row['own_rollout'], row['own_rollout_se'])} | {row['rollout']:.2f} | "
                       f"{pm(row['own_e2e'], row['own_e2e_se'])} |")
        else:
            per = ", ".join(f"{e[ep]['rollout']:.2f}" for e in each if ep in e)
            out.append(f"| {ep} | {row['steps']} | {per} | {pm(row['rollout'], row['rollout_se'])} | "
                       f"{pm(row['e2e'], row['e2e_se'])} |")
    return out


def pass_lines(units: list[dict]) -> list[str]:
    """A markdown table of where the passes go, per epoch over all units' steps after the first
    ``skip``: batch passes of each rollout (plain, the drafter, and the oracle for oracle units),
    milliseconds per pass (rollout seconds / passes, host time included; the oracle's search
    left out), the drafter's acceptance (accepted / drafted tokens) and its host drafting share
    of its rollout seconds. The drafter is ``own`` in oracle units, ``spec`` otherwise.

    Raises:
      ValueError: as ``pooled``.
    """
    pooled(units)  # the same checks
    oracle = units[0]["oracle"]
    names = ("plain", "own", "spec") if oracle else ("plain", "spec")
    drafter = "own" if oracle else "spec"
    sums: dict[int, dict[str, float]] = {}
    for u in units:
        for s in u["steps"]:
            if s["step"] <= u.get("skip", 1):
                continue
            e = sums.setdefault(int(s["rollout/epoch"]), {})
            for n in names:
                x = s[n]
                search = x.get("drafting_seconds", 0.0) if (oracle and n == "spec") else 0.0
                for key, v in (("passes", x["forward_passes"]), ("seconds", x["seconds"] - search),
                               ("drafted", x.get("drafted_tokens", 0.0)), ("accepted", x.get("accepted_tokens", 0.0)),
                               ("drafting", x.get("drafting_seconds", 0.0))):
                    e[f"{n}/{key}"] = e.get(f"{n}/{key}", 0.0) + v
    label = " / ".join(("plain", "goodput", "oracle") if oracle else ("plain", "HistoSpec"))
    out = [f"| epoch | batch passes {label} | ms per pass {label} | acceptance | host drafting share |",
           "|---|---|---|---|---|"]
    for ep, e in sorted(sums.items()):
        passes = " / ".join(f"{e[f'{n}/passes']:,.0f}" for n in names)
        ms = " / ".join(f"{1e3 * e[f'{n}/seconds'] / max(e[f'{n}/passes'], 1):.2f}" for n in names)
        drafted = e[f"{drafter}/drafted"]
        acc = f"{e[f'{drafter}/accepted'] / drafted:.2f}" if drafted else "- (no drafts)"
        share = e[f"{drafter}/drafting"] / max(e[f"{drafter}/seconds"], 1e-9)
        out.append(f"| {ep} | {passes} | {ms} | {acc} | {share:.1%} |")
    return out
