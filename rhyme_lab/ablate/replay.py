"""The HistoSpec drafter replayed along saved rollouts (K1-K4, K6 and K2's fixed policies).

Given the tokens a sequence emitted, the verify passes HistoSpec would take are fixed: a draft
token is accepted exactly when it equals the next emitted token. For sampled rollouts this is
not an approximation: with a one-hot draft x, lossless verification accepts with probability
p(x) and otherwise emits a token of p with x removed, which is how a token drawn from p relates
to x. So replaying the drafter along plain rollouts gives the pass counts and acceptance of live
HistoSpec in distribution, without the model (as ``python -m rhyme_lab replay-drafts`` and
``measure.pass_replay`` do; the loop is ``measure.draft_replay``'s). Drafts are cut as the engine
cuts them (longest first to the packed-token budget and the step program:
``rollout.allocation.choose_pass``), ``rows`` targets live at once; pages are not simulated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rhyme_jax.io.rollout_log import load_rollouts
from rhyme_lab.measure.draft_replay import replay_targets


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


def replay(spec_cfg, store, targets: list[Target], plan, rows: int) -> dict:
    """Draft along every target, ``rows`` at a time, with the ``spec`` section ``spec_cfg``
    drafting from ``store`` (module docstring; ``measure.draft_replay.replay_targets`` under the
    analytical pass-cost prior).

    Returns:
      ``acceptance`` (accepted / drafted), ``tokens_per_forward`` (target tokens per sequence
      pass), ``predicted_share`` (accepted / target tokens), ``hit_rate`` (passes with a draft /
      passes with room for one), ``mean_draft`` (drafted per non-empty draft), the counts, and
      ``draft_hist`` (passes per draft length 0..32).
    """
    from rhyme_jax.rollout.pass_cost import PassCost
    from rhyme_jax.spec.drafter import Drafter

    with Drafter(spec_cfg, store) as drafter:
        drafter.rebuild(sorted({t.pid for t in targets}))
        tot, _, _ = replay_targets(drafter, [t.prompt for t in targets], [t.tokens for t in targets],
                                   [t.pid for t in targets], plan, rows, PassCost.prior())
    tokens = int(sum(t.tokens.size for t in targets))
    d, p = tot.drafted, max(tot.passes, 1)
    return {"acceptance": tot.accepted / d if d else 0.0, "tokens_per_forward": tokens / p,
            "predicted_share": tot.accepted / max(tokens, 1),
            "hit_rate": tot.hits / max(tot.eligible, 1), "mean_draft": d / max(tot.hits, 1),
            "target_tokens": tokens, "passes": tot.passes, "drafted": d, "accepted": tot.accepted,
            "draft_hist": tot.draft_hist.tolist()}


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
