"""Deferred tails under ``one_step_off`` (ARCHITECTURE.md section 6): groups carried to the next step.

When a tail is deferred instead of migrated, its GRPO group cannot be trained yet (advantages
need all n rewards). The group is carried: its finished rows keep their responses, its deferred
rows keep their partial responses, and the next step's rollout continues those rows (prefill of
prompt + partial response, ``RolloutEngine.generate(prefixes=...)``). The completed group is
trained in that next step, so every prompt's n samples are trained exactly once. Carried groups
are saved in the checkpoint (``to_bytes`` / ``from_bytes``) so a resume loses nothing.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from rhyme_jax.rollout.types import RolloutResult


@dataclass
class Group:
    """One GRPO group of a step: prompt index (into the train problems), prompt tokens, and per
    sample its response tokens, behaviour logprobs and finish reason; ``pending[i]`` marks a
    deferred sample whose response is partial. ``origin`` is the step that scheduled the group."""

    prompt_idx: int
    prompt: np.ndarray
    tokens: list[np.ndarray]
    logprobs: list[np.ndarray]
    finish: list[str]
    pending: np.ndarray
    origin: int

    @property
    def complete(self) -> bool:
        return not bool(self.pending.any())


def split_step(step: int, idx: np.ndarray, prompts: Sequence[Sequence[int]], n: int, rows: np.ndarray,
               result: RolloutResult, deferred: dict[int, tuple[np.ndarray, np.ndarray]]) -> list[Group]:
    """The step's own groups from a scheduled rollout.

    Args:
      idx: ``int[P]`` prompt indices of the step; ``prompts``: ``P * n`` rows of prompt tokens.
      rows: ``int64[R]`` step rows present in ``result`` (own rows ``< P * n``), row order.
      deferred: row -> (partial tokens, logprobs) of the rows stopped for the next step.

    Raises:
      ValueError: a row is neither in ``result`` nor deferred (would be lost).
    """
    where = {int(r): i for i, r in enumerate(rows)}
    groups = []
    for g, pid in enumerate(idx):
        tok, lps, fin, pend = [], [], [], []
        for r in range(g * n, (g + 1) * n):
            if r in where:
                i = where[r]
                tok.append(result.tokens[i]), lps.append(result.logprobs[i]), fin.append(result.finish_reasons[i])
                pend.append(False)
            elif r in deferred:
                tok.append(deferred[r][0]), lps.append(deferred[r][1]), fin.append("deferred")
                pend.append(True)
            else:
                raise ValueError(f"sched/carry.py: row {r} of step {step} was neither rolled out nor deferred")
        groups.append(Group(int(pid), np.asarray(prompts[g * n], np.int32), tok, lps, fin, np.array(pend), step))
    return groups


def extras(carried: Sequence[Group]) -> list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]]:
    """Rows to continue next step: ``(group, sample, prompt, partial tokens, partial logprobs)``."""
    return [(g, i, grp.prompt, grp.tokens[i], grp.logprobs[i])
            for g, grp in enumerate(carried) for i in np.flatnonzero(grp.pending)]


def complete(carried: Sequence[Group], rows: Sequence[tuple[int, int]], result: RolloutResult,
             positions: Sequence[int]) -> list[Group]:
    """Fill carried groups' pending samples from the rows continued this step.

    Args:
      rows: ``(group, sample)`` of each continued row (``extras`` order).
      positions: index of each continued row in ``result``.
    """
    for (g, i), pos in zip(rows, positions):
        grp = carried[g]
        grp.tokens[i], grp.logprobs[i] = result.tokens[pos], result.logprobs[pos]
        grp.finish[i], grp.pending[i] = result.finish_reasons[pos], False
    return list(carried)


def to_bytes(groups: Sequence[Group]) -> bytes:
    """Serialise carried groups (npz: flat token/logprob arrays with offsets)."""
    lens = [len(t) for grp in groups for t in grp.tokens]
    arrays = {
        "meta": np.array([[grp.prompt_idx, grp.origin, len(grp.tokens), len(grp.prompt)] for grp in groups],
                         np.int64).reshape(-1, 4),
        "prompts": np.concatenate([grp.prompt for grp in groups]).astype(np.int32) if groups else np.zeros(0, np.int32),
        "lens": np.array(lens, np.int64),
        "tokens": np.concatenate([t for grp in groups for t in grp.tokens]).astype(np.int32) if lens else np.zeros(0, np.int32),
        "logprobs": (np.concatenate([x for grp in groups for x in grp.logprobs]).astype(np.float32)
                     if lens else np.zeros(0, np.float32)),
        "pending": np.array([p for grp in groups for p in grp.pending], bool),
        "finish": np.array([f for grp in groups for f in grp.finish], dtype="U16"),
    }
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def from_bytes(data: bytes, source: str) -> list[Group]:
    """Inverse of ``to_bytes``.

    Raises:
      ValueError: the bytes are not a carried-groups archive (names ``source``).
    """
    try:
        z = np.load(io.BytesIO(data))
        meta, prompts, lens = z["meta"], z["prompts"], z["lens"]
        tokens, logprobs, pending, finish = z["tokens"], z["logprobs"], z["pending"], z["finish"]
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"{source}: carried groups unreadable ({exc})") from None
    groups, p_off, s_off, t_off = [], 0, 0, 0
    for pid, origin, n, plen in meta:
        tok, lps = [], []
        for k in range(s_off, s_off + n):
            tok.append(tokens[t_off:t_off + lens[k]].copy())
            lps.append(logprobs[t_off:t_off + lens[k]].copy())
            t_off += lens[k]
        groups.append(Group(int(pid), prompts[p_off:p_off + plen].copy(), tok, lps,
                            [str(f) for f in finish[s_off:s_off + n]], pending[s_off:s_off + n].copy(), int(origin)))
        p_off += plen
        s_off += n
    return groups
