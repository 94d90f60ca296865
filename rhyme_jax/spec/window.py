"""HistoSpec draft-window policies (per sequence, vectorised numpy).

RhymeRL (arXiv 2508.18588) s.4 uses AIMD, the released specRL code MIMD.

* ``aimd`` (paper): start 2; after a draft with drafted > 0 that was fully accepted, +2 (cap 32);
  after any rejection, reset to 2.
* ``mimd`` (specRL code): start 2; fully accepted: x2 (cap 16); rejection: halve (floor 2).
* ``fixed``: always ``fixed``.

A step that drafted nothing (drafted == 0) leaves the window unchanged.
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Int

from rhyme_jax.config.sections import MAX_DRAFT, SpecSection

POLICIES = ("aimd", "mimd", "fixed")
START = 2
AIMD_STEP, AIMD_CAP = 2, 32
MIMD_CAP = 16


def _check(policy: str, fixed: int) -> None:
    if policy not in POLICIES:
        raise ValueError(f"window: expected one of {POLICIES}, got {policy!r}")
    if policy == "fixed" and not 0 <= int(fixed) <= MAX_DRAFT:
        raise ValueError(f"fixed_window: expected an integer in [0, {MAX_DRAFT}], got {fixed}")


def initial_window(policy: str, n: int, fixed: int = SpecSection.fixed_window) -> Int[np.ndarray, "n"]:
    """``int32[n]`` starting windows (2, or ``fixed`` for the fixed policy).

    Raises:
      ValueError: unknown policy, ``n`` < 0, or ``fixed`` outside [0, 32].
    """
    _check(policy, fixed)
    if int(n) < 0:
        raise ValueError(f"n: expected >= 0, got {n}")
    return np.full(int(n), int(fixed) if policy == "fixed" else START, dtype=np.int32)


def next_window(
    policy: str,
    window: Int[np.ndarray, "B"],
    drafted: Int[np.ndarray, "B"],
    accepted: Int[np.ndarray, "B"],
    fixed: int = SpecSection.fixed_window,
) -> Int[np.ndarray, "B"]:
    """Windows after one verify step.

    Args:
      policy: ``"aimd"`` | ``"mimd"`` | ``"fixed"``.
      window: ``int[B]`` current windows.
      drafted: ``int[B]`` draft tokens proposed this step (>= 0).
      accepted: ``int[B]`` of them accepted (0 <= accepted <= drafted).
      fixed: the window of the fixed policy.

    Returns:
      ``int32[B]`` new windows.

    Raises:
      ValueError: unknown policy, mismatched shapes, or accepted outside [0, drafted] (named).
    """
    _check(policy, fixed)
    w = np.asarray(window, dtype=np.int32)
    d = np.asarray(drafted, dtype=np.int64)
    a = np.asarray(accepted, dtype=np.int64)
    if w.ndim != 1 or d.shape != w.shape or a.shape != w.shape:
        raise ValueError(f"window/drafted/accepted: expected equal 1-D shapes, got {w.shape}/{d.shape}/{a.shape}")
    if np.any(d < 0) or np.any(a < 0) or np.any(a > d):
        raise ValueError("accepted: expected 0 <= accepted <= drafted (and drafted >= 0) per sequence")
    if policy == "fixed":
        return np.full(w.shape, int(fixed), dtype=np.int32)
    full = (d > 0) & (a == d)
    rejected = a < d
    if policy == "aimd":
        grown, shrunk = np.minimum(w + AIMD_STEP, AIMD_CAP), np.full_like(w, START)
    else:
        grown, shrunk = np.minimum(w * 2, MIMD_CAP), np.maximum(w // 2, START)
    return np.where(full, grown, np.where(rejected, shrunk, w)).astype(np.int32)
