"""The policy's own mode as a drafter: what a drafter that knows the policy could reach.

Every drafter of HistoSpec is model-free: its drafts come from earlier responses (history,
siblings, the row itself). The source-bound oracle (``oracle_drafters.SourceBoundDrafter``) cuts
those sources with hindsight: it knows the emitted tokens. Neither says what a *causal* drafter
could reach at best. This module gives that reference. Under the engine's coupling (each token's
draw keyed by its request and position; ``rollout/sampling.py``) a draft token ``d`` at a
position is accepted exactly when the policy samples ``d`` there, which happens with
probability ``p(d | prefix)``; no drafter that sees only the prefix can beat ``max_d p(d |
prefix)``: the policy's mode. ``ModeDrafter`` drafts the policy's greedy continuation (the mode
at each next position given that the earlier draft tokens were accepted), with the policy's
exact acceptance estimates (the running product of the modes' probabilities). Its draft tokens
along the emitted response are the teacher-forced argmaxes: the greedy continuation and the
emitted one agree up to the first draft token that differs, which is rejected, so every accepted
prefix is exact.

``ablate.policy_modes`` computes the teacher-forced argmax and mode probability at every response
position from the behaviour weights; ``save_modes`` / ``load_modes`` keep them beside a run's
saved rollouts (``<run>/policy_modes/step_%06d.npz``).
A drafter with the policy's knowledge costs a policy forward per draft token (it is a draft
model as large as the policy), so this is a reference, not a drafter to ship.

Source: issue 32 (the >= 90%-of-the-bound and >= 1.5x targets); Leviathan et al. 2023
(speculative sampling: acceptance of a draft token is ``min(1, p/q)``, ``p(d)`` for a
deterministic draft); RhymeRL (arXiv 2508.18588) s.4.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rhyme_jax.io.atomic import atomic_write
from rhyme_lab.measure.oracle_drafters import AlwaysRightDrafter
from rhyme_jax.rollout.shapes import MAX_DRAFT

MODES_DIR = "policy_modes"


class PolicyModeError(ValueError):
    """Policy modes that do not fit their rollouts (names the file or row)."""


def modes_path(run_dir: str | Path, step: int) -> Path:
    """``<run_dir>/policy_modes/step_{step:06d}.npz``."""
    return Path(run_dir) / MODES_DIR / f"step_{int(step):06d}.npz"


def save_modes(run_dir: str | Path, step: int, modes: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> Path:
    """One step's ``policy_modes`` atomically (arrays ``argmax``, ``p_mode``, ``logp``
    concatenated over rows, ``offsets int64[N + 1]``), in the rows' order of the step's rollouts."""
    lens = np.array([m[0].size for m in modes], np.int64)
    arrays = {"offsets": np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)}
    for k, name in enumerate(("argmax", "p_mode", "logp")):
        arrays[name] = np.concatenate([m[k] for m in modes]) if modes else np.zeros(0)
    path = modes_path(run_dir, step)
    with atomic_write(path) as fh:
        np.savez(fh, **arrays)
    return path


def load_modes(run_dir: str | Path, step: int, responses: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """``[(argmax int32[t_i], p_mode float32[t_i])]`` of a step saved by ``save_modes``.

    Raises:
      PolicyModeError: no file for the step, or its rows' lengths differ from ``responses``'
        (names the file and the first row that differs).
    """
    path = modes_path(run_dir, step)
    if not path.is_file():
        raise PolicyModeError(f"{path}: no such file (capture the run's modes first)")
    z = np.load(path)
    off = z["offsets"]
    lens = np.diff(off)
    want = np.array([len(r) for r in responses], np.int64)
    if lens.size != want.size or np.any(lens != want):
        bad = int(np.flatnonzero(lens != want)[0]) if lens.size == want.size else -1
        raise PolicyModeError(f"{path}: {lens.size} rows, response lengths differ from the rollouts' (row {bad})")
    return [(z["argmax"][a:b].astype(np.int32), z["p_mode"][a:b].astype(np.float32))
            for a, b in zip(off[:-1], off[1:])]


class ModeDrafter(AlwaysRightDrafter):
    """A ``rollout.types.Drafter`` that drafts the policy's greedy continuation (module docstring).

    Args:
      prompts: the call's prompts; responses: ``int32[t_i]`` each row's emitted response (only
        its length is read: rows are done when they reach it); modes: per row ``(argmax
        int32[t_i], p_mode float32[t_i])`` (``load_modes``); max_new_tokens: the longest response.

    Each draft is ``argmax[n: n + min(budget, MAX_DRAFT)]`` from the row's ``n`` emitted tokens;
    ``estimates`` (``float32[n, MAX_DRAFT]``) the running product of ``p_mode`` over those
    positions: the probability that the policy samples each draft prefix (exact up to the first
    rejected token, which is all the cut reads).

    Raises:
      PolicyModeError: a row's modes are not as long as its response.
    """

    def __init__(self, prompts, responses, modes, max_new_tokens: int):
        super().__init__(prompts, [m[0] for m in modes], max_new_tokens)
        if [m[0].size for m in modes] != [len(r) for r in responses]:
            raise PolicyModeError("ModeDrafter: the modes' lengths differ from the responses'")
        self.p_mode = [np.asarray(m[1], np.float64) for m in modes]

    def draft(self, reqs, tails, budgets):
        """``(int32[n, MAX_DRAFT], int32[n])``: the argmaxes ahead of each row."""
        reqs = np.asarray(reqs, np.int64)
        made = self.made(reqs, tails)
        out, lens = super().draft(reqs, tails, budgets)
        est = np.zeros((reqs.size, MAX_DRAFT), np.float32)
        for i, (r, n) in enumerate(zip(reqs, made)):
            p = self.p_mode[r][int(n): int(n) + int(lens[i])]
            est[i, : p.size] = np.cumprod(p)
        self.estimates = est
        return out, lens
