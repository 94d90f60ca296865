"""Upper bound on HistoSpec's rollout speed-up on this machine: a drafter that is always right.

``rhyme-jax replay-drafts`` replays the real drafter along target responses and models each step's
seconds with the engine's step-cost profile. This script replays the same corpus with a drafter
that knows the targets: every row's draft is its next target tokens (up to ``shapes.MAX_DRAFT``
and the tokens left), with acceptance estimates of 1 and the true remaining length as priority,
and the engine's own allocation (``allocation.choose_step``) picks each step's program. Every
drafted token is accepted, so no drafter over any source, with any acceptance estimates, can
emit more tokens per modelled second through the engine's programs: the printed
``modelled_speedup`` (plain decode's modelled seconds / the replay's) bounds what HistoSpec
can reach for these targets, rows and step-cost profile. (The allocation is per step and greedy;
prefill passes are left out of both sides; pages are not simulated.)

Usage::

    python benchmarks/replay_bound.py CORPUS.jsonl --tokenizer TOK --config configs/default.yaml \\
        --rows 128 --step-cost ~/.cache/rhyme_jax/step_cost/<profile>.json [--json]

CORPUS is ``rhyme-jax replay-drafts``' JSONL (benchmarks/replay_corpus.py builds one from a run's
saved rollouts); only prompts and targets are used.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from pass_replay import best_continuation  # noqa: E402

from rhyme_jax.measure.text_replay import read_cases, replay  # noqa: E402
from rhyme_jax.config import SpecSection, load_config  # noqa: E402
from rhyme_jax.model.tokenizer import Tokenizer  # noqa: E402
from rhyme_jax.rollout import shapes  # noqa: E402
from rhyme_jax.rollout.step_cost import StepCost  # noqa: E402


class PerfectBatch:
    """One group's drafts: each row's next target tokens (``DraftBatch`` interface)."""

    context_width = 1

    def __init__(self, targets: list[np.ndarray]):
        self.targets = targets
        self.done = np.zeros(len(targets), np.int64)
        self.estimates = self.priorities = None

    def draft(self, reqs, tails, budgets):
        reqs = np.asarray(reqs, np.int64)
        k = int(min(shapes.MAX_DRAFT, max(int(np.max(budgets, initial=0)), 1)))
        out = np.zeros((reqs.size, k), np.int32)
        lens = np.zeros(reqs.size, np.int64)
        for i, (r, b) in enumerate(zip(reqs, budgets)):
            nxt = self.targets[r][self.done[r]: self.done[r] + min(int(b), k)]
            out[i, : nxt.size], lens[i] = nxt, nxt.size
        self.estimates = np.ones((reqs.size, k), np.float32)
        self.priorities = np.array([self.targets[r].size - self.done[r] for r in reqs], np.float32)
        return out, lens

    def observe(self, reqs, lens, accepted):
        self.done[np.asarray(reqs, np.int64)] += np.asarray(accepted, np.int64) + 1


class SourceOracleBatch(PerfectBatch):
    """Each row's draft is the longest run of its next target tokens that some draft source
    holds: a continuation, after any occurrence of the context's last ``k`` tokens (``k`` from
    ``pattern_max`` down to 1), in the prompt's history responses, in the other targets of the
    same prompt emitted so far (siblings) or in the row's own context (self-lookup). Drafting
    exactly that run with estimates of 1 bounds every drafter over these sources."""

    def __init__(self, cases, pids: list[int], pattern_max: int):
        super().__init__([c.target for c in cases])
        self.cases, self.pids, self.pattern_max = cases, pids, pattern_max

    def _sources(self, r: int) -> list[np.ndarray]:
        c = self.cases[r]
        sibs = [self.cases[j].target[: self.done[j]] for j in range(len(self.cases))
                if j != r and self.pids[j] == self.pids[r] and self.done[j]]
        return [np.concatenate([c.prompt, h]) for h in c.history] + sibs

    def _best(self, r: int, budget: int) -> int:
        c, pos = self.cases[r], self.done[r]
        ctx = np.concatenate([c.prompt, c.target[:pos]])
        return best_continuation(ctx, c.target[pos: pos + budget], self._sources(r), self.pattern_max, 1,
                                 longest_only=False)

    def draft(self, reqs, tails, budgets):
        out, lens = super().draft(reqs, tails, budgets)
        for i, (r, b) in enumerate(zip(np.asarray(reqs, np.int64), budgets)):
            lens[i] = min(lens[i], self._best(int(r), int(min(b, out.shape[1]))))
        return out, lens


class PerfectDrafter:
    """Hands out ``PerfectBatch``es (or, with ``cases``, ``SourceOracleBatch``es) over
    consecutive groups of the corpus, in replay order."""

    def __init__(self, targets: list[np.ndarray], cases=None, pattern_max: int = SpecSection.pattern_max):
        self.targets, self.next, self.cases, self.pattern_max = targets, 0, cases, pattern_max

    def __call__(self, spec, store):  # replay's make_drafter(spec, store)
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def rebuild(self, prompt_ids):
        return None

    def batch(self, prompt_ids):
        lo, self.next = self.next, self.next + len(prompt_ids)
        if self.cases is not None:
            return SourceOracleBatch(self.cases[lo: self.next], list(prompt_ids), self.pattern_max)
        return PerfectBatch(self.targets[lo: self.next])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--step-cost", required=True, help="step-cost profile JSON of the engine's plan")
    ap.add_argument("--sources", action="store_true",
                    help="drafts limited to what the draft sources hold (history, siblings, self; best in hindsight)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    cases = read_cases(Path(args.file), Tokenizer.from_file(args.tokenizer).encode)
    r = cfg.rollout
    plan = shapes.plan(max_slots=args.rows, page_size=r.page_size, max_prompt_len=r.max_prompt_len,
                       max_new_tokens=r.max_new_tokens, max_verify_tokens=r.max_verify_tokens)
    cost = StepCost.load(args.step_cost)
    drafter = PerfectDrafter([c.target for c in cases], cases if args.sources else None, cfg.spec.pattern_max)
    out = replay(cases, cfg.spec, plan, args.rows, cost, make_drafter=drafter)
    out = {"rows": args.rows, "step_cost": args.step_cost, "sources": args.sources, **out}
    if args.json:
        print(json.dumps(out))
    else:
        what = "best-in-hindsight drafts from the sources" if args.sources else "always-right drafts"
        print(f"{len(cases)} targets, {out['target_tokens']} tokens, {args.rows} rows: {what} give "
              f"{out['tokens_per_forward']:.2f} tokens per sequence pass, modelled speed-up "
              f"{out['modelled_speedup']:.2f}x over plain decode (upper bound)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
