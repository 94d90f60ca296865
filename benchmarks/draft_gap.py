"""Where the run's drafter falls short of the source-bound oracle, by cause, source and position.

Replays the run's own drafter over its saved rollouts (``rhyme_lab.measure.draft_gap``: the
history store as the trainer held it, finished siblings as sources, every drafted token sent) and
at each sequence pass compares the tokens it got accepted with the longest run the oracle could
have had accepted from the same context, per source (history, siblings, self): a pass's one
non-draft token is missed where the oracle's run is longer. Prints per epoch, as shares of the
generated tokens, what the drafter's accepted drafts carry and the missed tokens, split by cause
(no draft / wrong draft / short draft), by the source that held the oracle's run, and by response
position; and the drafter's acceptance estimates (what the engine's cut weighs) binned against
whether each tested draft token (accepted, or the first rejected) was accepted. No model runs; a
50-step demo run takes seconds.

Usage::

    python -m benchmarks.draft_gap results/learning/runs/learn_oracle_paired [--from-epoch 2] [--json]
    python -m benchmarks.draft_gap RUN --set spec.siblings=false     # the drafter without siblings
    python -m benchmarks.draft_gap RUN --unit results/learning/units/learn_oracle_paired.json
        # each pass sends what the engine's allocation would under the unit's pass-cost profile
    python -m benchmarks.draft_gap RUN --unit UNIT.json --bound
        # estimates or drafts? (``rhyme_lab.measure.cut_bound``): modelled speed-up over plain of
        # the drafter with its own estimates, the same drafter knowing which of its draft tokens
        # hold, and the source-bound oracle, all sized by the engine's allocation under the profile;
        # where RUN has policy_modes/ (``python -m benchmarks.policy_modes``), also the policy's own
        # greedy drafts (``rhyme_lab.measure.policy_mode``): what a drafter knowing the policy reaches;
        # with --cross-prompt also the oracle whose sources hold other prompts' responses
    python -m benchmarks.draft_gap RUN --rules
        # which history occurrence to draft from (``rhyme_lab.measure.occurrence_rules``): passes and
        # carried tokens of causal choice rules against hindsight, every drafted token sent
"""

from __future__ import annotations

import argparse
import json
import sys

from rhyme_lab.ablate.saved_runs import CorpusError, cut_bound_run, draft_gap_run, occurrence_rules_run
from rhyme_lab.measure import cut_bound, occurrence_rules
from rhyme_lab.measure.draft_gap import CAUSES, ESTIMATE_BINS, SOURCES


def table(gaps: dict[int, dict]) -> list[str]:
    """Markdown tables of ``draft_gap_run``'s result: shares of the generated tokens per epoch."""
    head = ["| epoch | tokens | sequence passes | acceptance | carried by accepted drafts | missed |"
            + "".join(f" {c} |" for c in CAUSES) + "".join(f" from {s} |" for s in SOURCES),
            "|---" * (6 + len(CAUSES) + len(SOURCES)) + "|"]
    pos_keys = sorted({k for g in gaps.values() for k in g["by_position"]},
                      key=lambda k: int(k.split("-")[0].lstrip(">=")))
    pos = ["| epoch |" + "".join(f" positions {k} |" for k in pos_keys), "|---" * (1 + len(pos_keys)) + "|"]
    for ep, g in gaps.items():
        n = max(g["tokens"], 1)
        acc = g["accepted"] / max(g["drafted"], 1)
        head.append(f"| {ep} | {g['tokens']:,} | {g['passes']:,} | {acc:.2f} | {g['accepted'] / n:.1%} | "
                    f"{g['missed'] / n:.1%} |" + "".join(f" {g['by_cause'].get(c, 0) / n:.1%} |" for c in CAUSES)
                    + "".join(f" {g['by_source'].get(s, 0) / n:.1%} |" for s in SOURCES))
        pos.append(f"| {ep} |" + "".join(f" {g['by_position'].get(k, 0) / n:.1%} |" for k in pos_keys))
    cal = ["| epoch |" + "".join(f" estimate {b / ESTIMATE_BINS:.1f}-{(b + 1) / ESTIMATE_BINS:.1f} |"
                                 for b in range(ESTIMATE_BINS)), "|---" * (1 + ESTIMATE_BINS) + "|"]
    for ep, g in gaps.items():
        c = g["calibration"]
        cal.append(f"| {ep} |" + "".join(f" {e / n:.3f} -> {a / n:.3f} ({n:,}) |" if n else " - |"
                                         for n, a, e in zip(c["tested"], c["accepted"], c["estimate_sum"])))
    return (head + ["", "Missed tokens by response position (share of the epoch's generated tokens):", ""] + pos
            + ["", "The drafter's estimates (acceptance given the earlier draft tokens were accepted): acceptance "
                   "of the tested draft tokens per estimate bin, mean estimate -> acceptance (tokens tested):", ""]
            + cal)


def bound_table(bounds: dict[int, dict]) -> list[str]:
    """Markdown table of ``cut_bound_run``'s result: per epoch, each mode's modelled speed-up over
    plain decode, its share of the oracle's, the draft tokens its accepted drafts carry (share of
    the generated tokens), its acceptance and sequence passes."""
    first = next(iter(bounds.values()), {})
    modes = [m for m in cut_bound.MODES + cut_bound.POLICY_MODES + (cut_bound.CROSS_MODE,) if m in first]
    own = [m for m in modes if m != "oracle"]
    out = ["| epoch | tokens |" + "".join(f" {m} x | {m}: of the oracle |" for m in own) + " oracle x |"
           + "".join(f" {m}: carried / acceptance / passes |" for m in modes), "|---" * (3 + 2 * len(own) + len(modes)) + "|"]
    for ep, b in bounds.items():
        r, n = cut_bound.ratios(b), max(b["tokens"], 1)
        out.append(f"| {ep} | {b['tokens']:,} |" + "".join(f" {r[m]:.2f} | {r[m + '_share']:.1%} |" for m in own)
                   + f" {r['oracle']:.2f} |"
                   + "".join(f" {b[m]['accepted'] / n:.1%} / {b[m]['accepted'] / max(b[m]['drafted'], 1):.2f} / "
                             f"{b[m]['passes']:,} |" for m in modes))
    return out


def rules_table(rules: dict[int, dict]) -> list[str]:
    """Markdown table of ``occurrence_rules_run``'s result: per epoch and rule, the sequence passes
    and the share of the generated tokens its accepted drafts carry (rows with history only)."""
    names = occurrence_rules.RULES
    out = ["| epoch | tokens |" + "".join(f" {r}: passes / carried |" for r in names), "|---" * (2 + len(names)) + "|"]
    for ep, got in rules.items():
        n = max(got[names[0]]["tokens"], 1)
        out.append(f"| {ep} | {n:,} |" + "".join(f" {got[r]['passes']:,} / {got[r]['carried'] / n:.1%} |"
                                                for r in names))
    return out


def unit_cost(path: str):
    """The ``PassCost`` of the profile a unit JSON recorded (``result.step_cost``, its profiled
    programs; ``ablate.oracle.cost_model``). Raises ``OSError`` / ``ValueError`` / ``KeyError`` on
    a file that is not such a unit."""
    from rhyme_lab.ablate.oracle import cost_model

    with open(path) as f:
        rec = json.load(f)["result"]["step_cost"]
    return cost_model({"profiled": rec["profiled"], "meta": rec.get("meta", {})})[0]


def main(argv=None) -> int:
    """Command line (module docstring); returns the exit status (2: no config or no steps)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="run directory with config.yaml, its tokenizer and rollouts/")
    ap.add_argument("--from-epoch", type=int, default=2, help="report steps of this epoch on")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override the run's config (its spec section is the drafter replayed)")
    ap.add_argument("--unit", default="", help="a unit JSON whose recorded pass-cost profile sizes each pass as "
                    "the engine's allocation would (default: every drafted token sent)")
    ap.add_argument("--bound", action="store_true", help="with --unit: the drafter with its estimates, knowing "
                    "its acceptance, and the source-bound oracle under the profile (rhyme_lab.measure.cut_bound)")
    ap.add_argument("--cross-prompt", action="store_true", help="with --bound: also the oracle whose sources hold "
                    "every prompt's earlier responses and the step's other rows (oracle_cross)")
    ap.add_argument("--rules", action="store_true", help="causal rules for the history occurrence to draft from, "
                    "against hindsight (rhyme_lab.measure.occurrence_rules)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.bound and not args.unit:
        print("benchmarks.draft_gap: --bound needs --unit (the pass-cost profile that sizes each pass)", file=sys.stderr)
        return 2
    try:
        cost = unit_cost(args.unit) if args.unit else None
        if args.rules:
            got, lines = occurrence_rules_run(args.run, args.overrides, args.from_epoch), rules_table
        elif args.bound:
            got, lines = cut_bound_run(args.run, cost, args.overrides, args.from_epoch, args.cross_prompt), bound_table
        else:
            got, lines = draft_gap_run(args.run, args.overrides, args.from_epoch, cost), table
    except (CorpusError, OSError, ValueError, KeyError) as exc:
        print(f"benchmarks.draft_gap: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(got) if args.json else "\n".join(lines(got)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
