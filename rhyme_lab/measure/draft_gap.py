"""Where a drafter's accepted tokens fall short of the source-bound oracle's, pass by pass.

The paired oracle units show the goodput drafter's drafts carrying 88% of the generated tokens
where the source-bound oracle's carry 92% (docs/results.md, L1). This module says where the
difference is, without a model: it replays the run's own drafter over one step's emitted tokens
(``pass_replay.replay_step``'s way: the history store as the trainer held it, finished siblings
as sources; every drafted token sent, or what the engine's cost-aware cut would send) and, at
each sequence pass, asks what the oracle could have
had accepted from the same context: ``oracle_drafters.held_run`` (the longest run of the next
emitted tokens that follows an occurrence of the context's last token) over each source apart,

* ``history``: the prompt's earlier responses (prompt prepended), as the history store keeps them;
* ``siblings``: the same prompt's responses in this step, up to what they had emitted before
  the pass (prompt prepended; the drafter sees a sibling only once it finished);
* ``self``: the sequence's own context.

Each pass emits its accepted draft tokens and one more (the resampled or bonus token); that one
token is **missed** when the oracle's run there is longer than what the drafter got accepted and
the pass did not end the response (the oracle would have carried it in a draft and gone on).
Every generated token after the prefill's is either carried by an accepted draft or the one
token of a pass, so the missed tokens count, without overlap, tokens a drafter over the same
sources could have drafted. A missed token has one cause:

* ``no draft``: the drafter sent nothing;
* ``wrong draft``: it sent a draft whose first tokens were rejected before the oracle's run ended;
* ``short draft``: every sent token was accepted, but the oracle's run was longer.

and one source: the first of history, siblings, self whose run is the oracle's (ties go to the
earlier), and the response position of the pass (``POSITION_EDGES``). It is a count along the
drafter's own passes, not the token gap of two rollouts (the oracle's passes split the
responses differently), but it says which cause and which source to work on, and where.

It also checks the drafter's acceptance estimates (``DraftBatch.estimates``: a token's
acceptance given the draft tokens before it were accepted, what the engine's cost-aware cut
weighs): every tested draft token's estimate (the accepted ones and the first rejected one of
each sent draft, as ``spec.calibration`` counts trials), binned, against whether it was accepted
(``calibration``: tokens tested and accepted and the sum of their estimates, per bin).

Source: issue 32 (speed on a learning run), the next step of its note; RhymeRL section 4.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from jaxtyping import Int

from rhyme_lab.measure.draft_replay import drive
from rhyme_lab.measure.oracle_drafters import held_run
from rhyme_lab.measure.pass_replay import WithSiblings, sibling_rebatch
from rhyme_jax.spec.drafter import Drafter
from rhyme_jax.spec.history import HistoryStore

SOURCES = ("history", "siblings", "self")
ESTIMATE_BINS = 10  # equal-width bins of [0, 1] for the calibration of the drafter's estimates
CAUSES = ("no draft", "wrong draft", "short draft")
POSITION_EDGES = (0, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # response position buckets [a, b)


def position_bucket(pos: int) -> str:
    """``"a-b"``: the ``POSITION_EDGES`` bucket holding response position ``pos`` (``">=N"`` past
    the last edge)."""
    for lo, hi in zip(POSITION_EDGES, POSITION_EDGES[1:]):
        if lo <= pos < hi:
            return f"{lo}-{hi - 1}"
    return f">={POSITION_EDGES[-1]}"


def oracle_runs(ctx: np.ndarray, rest: np.ndarray, history: list[np.ndarray],
                siblings: list[np.ndarray]) -> dict[str, int]:
    """``held_run`` of ``rest`` (``int32[n]`` the next emitted tokens) after ``ctx`` (``int32[c]``)
    over each source apart: ``{"history": .., "siblings": .., "self": ..}`` (token counts)."""
    return {"history": held_run(history, ctx, rest) if history else 0,
            "siblings": held_run(siblings, ctx, rest) if siblings else 0,
            "self": held_run([], ctx, rest)}


class EstimateTally:
    """Tested and accepted draft tokens and the sum of their estimates per estimate bin
    (``ESTIMATE_BINS`` equal bins of [0, 1]): ``add`` one sent draft at a time."""

    def __init__(self):
        self.tested = np.zeros(ESTIMATE_BINS, np.int64)
        self.accepted = np.zeros(ESTIMATE_BINS, np.int64)
        self.estimate_sum = np.zeros(ESTIMATE_BINS)

    def add(self, estimates: np.ndarray, sent: int, accepted: int) -> None:
        """A draft of ``sent`` tokens whose first ``accepted`` were accepted; ``estimates``: its
        tokens' conditional acceptance estimates (``float[>= sent]``). The accepted tokens and
        the first rejected one were tested; later ones were not."""
        e = np.asarray(estimates[: min(accepted + 1, sent)], np.float64)
        b = np.minimum((e * ESTIMATE_BINS).astype(np.int64), ESTIMATE_BINS - 1)
        np.add.at(self.tested, b, 1)
        np.add.at(self.estimate_sum, b, e)
        np.add.at(self.accepted, b[:accepted], 1)

    def as_dict(self) -> dict:
        """``{"tested", "accepted", "estimate_sum"}`` as lists."""
        return {"tested": self.tested.tolist(), "accepted": self.accepted.tolist(),
                "estimate_sum": self.estimate_sum.tolist()}


def gap_step(spec, max_new: int, prompts: dict, pids: Int[np.ndarray, "N"], responses, rewards,
             history: HistoryStore, window: int = 32, send=None, drafter: Drafter | None = None) -> dict:
    """One step's shortfall against the oracle (module docstring).

    Args:
      spec: the ``spec`` config section of the run; ``max_new``: ``rollout.max_new_tokens``.
      prompts: prompt id -> ``int32[p]``; ``pids``: ``int[N]`` prompt id per row.
      responses, rewards: the step's emitted ``int32[L_i]`` responses and their rewards.
      history: the history store as the trainer held it when the step ran.
      window: most tokens the oracle drafts per pass (the engine's ``shapes.MAX_DRAFT``).
      send: ``drive``'s ``send`` (``draft_replay.EnginePasses``: the engine's cost-aware cut of
        each pass's drafts); ``None``: every drafted token is sent.
      drafter: the run's ``Drafter`` to draft with (its store is set to this step's; its
        calibration carries over from earlier steps, as the engine's does over a run); ``None``:
        a fresh one for this step (estimates from the calibration's prior).

    Returns ``{"tokens", "passes", "drafted", "accepted", "missed", "by_cause": {cause: tokens},
    "by_source": {source: tokens}, "by_position": {bucket: tokens}, "calibration": {"tested",
    "accepted", "estimate_sum": [ESTIMATE_BINS] each}}``: generated tokens, sequence passes after
    the prefill, draft tokens sent and accepted, missed tokens and their split, and per estimate
    bin the tested and accepted draft tokens and the sum of the tested ones' estimates (token
    counts; none for a drafter without estimates).
    """
    store = WithSiblings(history, prompts, responses, rewards)
    own = drafter is None
    if own:
        drafter = Drafter(spec, store)
    drafter.store = store
    rows = [np.asarray(prompts[int(p)], np.int64) for p in pids]
    targets = [np.asarray(r, np.int64) for r in responses]
    hist = {int(p): [np.concatenate([prompts[int(p)], h]) for h in history.responses(int(p))[0]]
            if int(p) in history else [] for p in np.unique(pids)}
    sibs = {int(p): np.flatnonzero(np.asarray(pids) == p) for p in np.unique(pids)}
    out = {"tokens": int(sum(t.size for t in targets)), "passes": 0, "drafted": 0, "accepted": 0, "missed": 0,
           "by_cause": defaultdict(int), "by_source": defaultdict(int), "by_position": defaultdict(int)}
    before = np.minimum(1, np.array([t.size for t in targets], np.int64))  # the prefill's token
    cal, seen = EstimateTally(), {}

    def sending(batch, lens, left):  # what the pass's drafts were estimated at, then the cut
        seen["estimates"] = getattr(batch, "estimates", None)
        return lens if send is None else send(batch, lens, left)

    def tally(live, lens, accepted, done):
        est = seen.get("estimates")
        for i, (r, n, a) in enumerate(zip(live, lens, accepted)):
            if est is not None and n:
                cal.add(est[i], int(n), int(a))
            pos, pid = int(before[r]), int(pids[r])
            ctx = np.concatenate([rows[r], targets[r][:pos]])
            rest = targets[r][pos: pos + min(window, max(max_new - pos - 1, 0))]
            sib = [np.concatenate([rows[j], targets[j][: before[j]]]) for j in sibs[pid] if j != r]
            runs = oracle_runs(ctx, rest, hist[pid], sib)
            best = max(runs.values())
            out["passes"] += 1
            out["drafted"] += int(n)
            out["accepted"] += int(a)
            if best <= a or a + 1 >= targets[r].size - pos:  # nothing longer held, or the response ended
                continue
            out["missed"] += 1
            out["by_cause"]["no draft" if n == 0 else ("wrong draft" if a < n else "short draft")] += 1
            out["by_source"][next(s for s in SOURCES if runs[s] == best)] += 1
            out["by_position"][position_bucket(pos)] += 1
        before[live] = done[live]

    try:
        drive(drafter.batch(pids), rows, targets, emitted=1, max_new=max_new, send=sending,
              rebatch=sibling_rebatch(drafter, store, pids, targets, on_pass=tally))
    finally:
        if own:
            drafter.close()
    out["calibration"] = cal.as_dict()
    return {k: dict(v) if isinstance(v, defaultdict) else v for k, v in out.items()}


def merge(steps: list[dict]) -> dict:
    """Sum of ``gap_step`` results."""
    total: dict = {"tokens": 0, "passes": 0, "drafted": 0, "accepted": 0, "missed": 0, "by_cause": {},
                   "by_source": {}, "by_position": {},
                   "calibration": {k: [0] * ESTIMATE_BINS for k in ("tested", "accepted", "estimate_sum")}}
    for s in steps:
        for k in ("tokens", "passes", "drafted", "accepted", "missed"):
            total[k] += s[k]
        for k in ("by_cause", "by_source", "by_position"):
            for key, v in s[k].items():
                total[k][key] = total[k].get(key, 0) + v
        for k in ("tested", "accepted", "estimate_sum"):
            total["calibration"][k] = [x + y for x, y in zip(total["calibration"][k], s["calibration"][k])]
    return total
