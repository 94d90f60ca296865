"""The HistoSpec drafter replayed along saved rollouts (K1-K4, K6 and K2's fixed policies).

Given the tokens a sequence emitted, the verify passes HistoSpec would take are fixed: a draft
token is accepted exactly when it equals the next emitted token. For sampled rollouts this is
not an approximation: with a one-hot draft x, lossless verification accepts with probability
p(x) and otherwise emits a token of p with x removed, which is how a token drawn from p relates
to x. So replaying the drafter along plain rollouts gives the pass counts and acceptance of live
HistoSpec in distribution, without the model (as ``rhyme-jax replay-drafts`` and
``benchmarks/pass_replay.py`` do). Drafts are cut as the engine cuts them (longest first to the
packed-token budget and the step program: ``rollout.allocation.choose_step``), ``rows``
targets live at once; pages are not simulated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rhyme_jax.config.sections import MAX_DRAFT
from rhyme_jax.io.rollout_log import load_rollouts


@dataclass(frozen=True)
class Target:
    """One response to replay: its prompt id, prompt tokens and response tokens (``int32``)."""

    pid: int
    prompt: np.ndarray
    tokens: np.ndarray


def epoch_rollouts(run_dir, epoch: int) -> dict:
    """``load_rollouts`` of one saved epoch (step ``epoch``) of the session."""
    return load_rollouts(run_dir, epoch)


def history_store(prompts: dict[int, list[int]], epochs: list[dict], depth: int):
    """A ``HistoryStore`` of depth ``depth`` with ``epochs`` (``load_rollouts`` dicts, oldest
    first) written in as the trainer writes its steps."""
    from rhyme_jax.spec.history import HistoryStore

    store = HistoryStore(depth)
    for k, ep in enumerate(epochs, 1):
        ids = ep["prompt_ids"]
        store.update(k, ids, [np.asarray(prompts[int(p)], np.int32) for p in ids], ep["responses"],
                     np.asarray(ep["rewards"], np.float64))
    return store


def targets_of(prompts: dict[int, list[int]], epoch: dict) -> list[Target]:
    """The responses of one epoch as replay targets (empty responses dropped)."""
    return [Target(int(p), np.asarray(prompts[int(p)], np.int32), np.asarray(r, np.int32))
            for p, r in zip(epoch["prompt_ids"], epoch["responses"]) if len(r)]


def _tails(targets: list[Target], live: list[int], done: np.ndarray, width: int) -> np.ndarray:
    """``int32[n, width]`` last tokens of prompt + response so far of the live targets, -1 padded."""
    out = np.full((len(live), width), -1, np.int32)
    for i, c in enumerate(live):
        seq = np.concatenate([targets[c].prompt, targets[c].tokens[: done[c]]])[-width:]
        out[i, width - seq.size:] = seq
    return out


def _fit(plan, lens: np.ndarray, batch, left: np.ndarray) -> np.ndarray:
    """The engine's choice of one step's draft lengths (``rollout.allocation.choose_step``: the
    paper windows' fixed rule, or with the drafter's estimates the goodput choice under the
    analytical step-cost prior)."""
    from rhyme_jax.rollout import allocation
    from rhyme_jax.rollout.step_cost import StepCost

    lens = np.minimum(np.minimum(lens, MAX_DRAFT), np.maximum(left - 1, 0))
    choice, _ = allocation.choose_step(plan, lens, batch.estimates, StepCost.prior(), batch.priorities)
    return choice.draft_lens


def _group(targets, group: list[int], drafter, plan, tot: dict) -> None:
    """Replay the targets ``group`` (live together) to their end; adds to ``tot``."""
    batch = drafter.batch([targets[c].pid for c in group])
    size = np.array([targets[c].tokens.size for c in group], np.int64)
    done = np.zeros(len(targets), np.int64)
    while True:
        reqs = np.flatnonzero(done[group] < size)
        if not reqs.size:
            return
        live = [group[j] for j in reqs]
        left = size[reqs] - done[live]
        drafts, lens = batch.draft(reqs, _tails(targets, live, done, batch.context_width), np.maximum(left - 1, 0))
        lens = _fit(plan, np.asarray(lens, np.int64), batch, left)
        acc = np.zeros(len(live), np.int64)
        for i, c in enumerate(live):
            want = targets[c].tokens[done[c]: done[c] + lens[i]]
            match = drafts[i, : lens[i]] == want
            acc[i] = lens[i] if match.all() else int(np.argmin(match))
            done[c] += int(acc[i]) + 1
        batch.observe(reqs, lens, acc)
        tot["passes"] += len(live)
        tot["eligible"] += int((left > 1).sum())
        tot["hits"] += int((lens > 0).sum())
        tot["drafted"] += int(lens.sum())
        tot["accepted"] += int(acc.sum())
        tot["draft_hist"] += np.bincount(lens, minlength=MAX_DRAFT + 1)[: MAX_DRAFT + 1]


def replay(spec_cfg, store, targets: list[Target], plan, rows: int) -> dict:
    """Draft along every target, ``rows`` at a time, with the ``spec`` section ``spec_cfg``
    drafting from ``store`` (module docstring).

    Returns:
      ``acceptance`` (accepted / drafted), ``tokens_per_forward`` (target tokens per sequence
      pass), ``predicted_share`` (accepted / target tokens), ``hit_rate`` (passes with a draft /
      passes with room for one), ``mean_draft`` (drafted per non-empty draft), the counts, and
      ``draft_hist`` (passes per draft length 0..32).
    """
    from rhyme_jax.spec.drafter import Drafter

    tot = dict(passes=0, eligible=0, hits=0, drafted=0, accepted=0, draft_hist=np.zeros(MAX_DRAFT + 1, np.int64))
    with Drafter(spec_cfg, store) as drafter:
        drafter.rebuild(sorted({t.pid for t in targets}))
        for start in range(0, len(targets), rows):
            _group(targets, list(range(start, min(start + rows, len(targets)))), drafter, plan, tot)
    tokens = int(sum(t.tokens.size for t in targets))
    d, p = tot["drafted"], max(tot["passes"], 1)
    return {"acceptance": tot["accepted"] / d if d else 0.0, "tokens_per_forward": tokens / p,
            "predicted_share": tot["accepted"] / max(tokens, 1),
            "hit_rate": tot["hits"] / max(tot["eligible"], 1), "mean_draft": d / max(tot["hits"], 1),
            "target_tokens": tokens, "passes": tot["passes"], "drafted": d, "accepted": tot["accepted"],
            "draft_hist": tot["draft_hist"].tolist()}


def epoch_sets(epochs: int, depth: int) -> list[tuple[tuple[int, ...], int]]:
    """``(history epochs, target epoch)`` pairs of a session with ``epochs`` i.i.d. epochs (one
    fixed policy: any other epochs may serve as history): every target with every ordered choice
    of ``depth`` other epochs for depth 1, every set of ``depth`` others for deeper histories."""
    from itertools import combinations, permutations

    out = []
    for t in range(1, epochs + 1):
        others = [e for e in range(1, epochs + 1) if e != t]
        picks = permutations(others, 1) if depth == 1 else combinations(others, depth)
        out += [(tuple(h), t) for h in picks]
    return out
