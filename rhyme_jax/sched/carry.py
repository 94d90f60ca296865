"""Rows and groups carried between rollouts (docs/architecture.md, "HistoPipe").

``CarriedRow`` is the one form of a sample whose response one rollout began and another continues:
a tail migrated to an idle worker within a step, or a tail deferred to a later step.

When a tail is deferred instead of migrated, its GRPO group cannot be trained yet (advantages
need all n rewards). The group is carried: its finished rows keep their responses, its deferred
rows keep their partial responses, and the next step's rollout continues those rows (prefill of
prompt + partial response, ``RolloutEngine.generate(prefixes=...)``). The completed group is
trained in that next step, so every prompt's n samples are trained exactly once. Carried groups
(``sched.step_group.StepGroup``) are saved in the checkpoint (``to_bytes`` / ``from_bytes``) so a resume loses nothing.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from jaxtyping import Float, Int

from rhyme_jax.rollout.types import RolloutResult
from rhyme_jax.sched.step_group import StepGroup


@dataclass(frozen=True)
class CarriedRow:
    """One sample whose response one rollout began and another continues: a tail stopped on its
    worker and continued by an idle one (sync migration), or deferred and continued by a later
    step's rollout (one_step_off). The single form such a row takes from the scheduler to the
    engine call (``prefix``) and back.

    Attributes:
      row: the row it has in the rollout it is part of: the step row ``g * n + i`` (group g,
        sample i) when a rollout stops it; ``P * n + e`` when a later rollout of P prompts
        continues it as its e-th carried row (``pending_rows``).
      prompt_idx: index of its prompt among the train problems.
      prompt: ``int32[p]`` prompt token ids.
      tokens: ``int32[m]`` response tokens generated so far.
      logprobs: ``float32[m]`` behaviour logprobs of ``tokens``.
      source: the rollout worker that stopped it; -1 when none (continued from an earlier step).
    """

    row: int
    prompt_idx: int
    prompt: Int[np.ndarray, "p"]
    tokens: Int[np.ndarray, "m"]
    logprobs: Float[np.ndarray, "m"]
    source: int = -1

    @property
    def prefix(self) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens, logprobs)``: the entry of ``RolloutEngine.generate(prefixes=...)`` that
        continues this row."""
        return self.tokens, self.logprobs


def split_step(step: int, idx: np.ndarray, prompts: Sequence[Sequence[int]], n: int, rows: np.ndarray,
               result: RolloutResult, deferred: Sequence[CarriedRow]) -> list[StepGroup]:
    """The step's own groups from a scheduled rollout.

    Args:
      idx: ``int[P]`` prompt indices of the step; ``prompts``: ``P * n`` rows of prompt tokens.
      rows: ``int64[R]`` step rows present in ``result`` (own rows ``< P * n``), row order.
      deferred: the rows stopped for a later rollout (``row`` = their step row).

    Raises:
      ValueError: a row is neither in ``result`` nor deferred (would be lost).
    """
    where = {int(r): i for i, r in enumerate(rows)}
    stopped = {d.row: d for d in deferred}
    groups = []
    for g, pid in enumerate(idx):
        tok, lps, fin, pend = [], [], [], []
        for r in range(g * n, (g + 1) * n):
            if r in where:
                i = where[r]
                tok.append(result.tokens[i]), lps.append(result.logprobs[i]), fin.append(result.finish_reasons[i])
                pend.append(False)
            elif r in stopped:
                tok.append(stopped[r].tokens), lps.append(stopped[r].logprobs), fin.append("deferred")
                pend.append(True)
            else:
                raise ValueError(f"sched/carry.py: row {r} of step {step} was neither rolled out nor deferred")
        groups.append(StepGroup(int(pid), np.asarray(prompts[g * n], np.int32), tok, lps, fin, np.array(pend), step))
    return groups


def _pending(carried: Sequence[StepGroup]) -> list[tuple[int, int]]:
    """``(group, sample)`` of every deferred sample of ``carried``, in group then sample order."""
    return [(g, int(i)) for g, grp in enumerate(carried) for i in np.flatnonzero(grp.pending)]


def pending_rows(carried: Sequence[StepGroup], first_row: int) -> list[CarriedRow]:
    """The deferred samples of ``carried`` as the rows a rollout continues: the e-th (in group
    then sample order) becomes row ``first_row + e`` (``first_row`` = the rollout's own rows P * n)."""
    return [CarriedRow(first_row + e, carried[g].prompt_idx, carried[g].prompt, carried[g].tokens[i],
                       carried[g].logprobs[i]) for e, (g, i) in enumerate(_pending(carried))]


def complete(carried: Sequence[StepGroup], result: RolloutResult, positions: Sequence[int]) -> list[StepGroup]:
    """Fill carried groups' deferred samples from the rollout that continued them.

    Args:
      carried: the groups ``pending_rows`` turned into that rollout's carried rows.
      positions: index in ``result`` of each carried row, in ``pending_rows`` order.

    Raises:
      ValueError: not one position per deferred sample.
    """
    samples = _pending(carried)
    if len(samples) != len(positions):
        raise ValueError(f"sched/carry.py: {len(positions)} continued rows for {len(samples)} deferred samples")
    for (g, i), pos in zip(samples, positions):
        grp = carried[g]
        grp.tokens[i], grp.logprobs[i] = result.tokens[pos], result.logprobs[pos]
        grp.finish[i], grp.pending[i] = result.finish_reasons[pos], False
    return list(carried)


def step_groups(step: int, idx: np.ndarray, prompts: Sequence[Sequence[int]], n: int, carried: Sequence[StepGroup],
                rows: np.ndarray, result: RolloutResult,
                deferred: Sequence[CarriedRow]) -> tuple[list[StepGroup], list[StepGroup]]:
    """A finished rollout as GRPO groups: ``(trainable, still pending)``.

    Args:
      step, idx, prompts, n: the step's prompts (``split_step``); its own rows are ``< P * n``.
      carried: the groups whose ``pending_rows`` the rollout continued (rows ``>= P * n``).
      rows, result: ``int64[R]`` ascending rows of ``result`` (own rows, then continued ones).
      deferred: own rows stopped for a later rollout.

    Returns:
      The completed carried groups followed by the step's complete groups, and the step's groups
      with deferred samples (carried on).
    """
    own = np.asarray(rows) < len(prompts)
    pos = np.flatnonzero(own)
    mine = RolloutResult([result.tokens[i] for i in pos], [result.logprobs[i] for i in pos],
                         [result.finish_reasons[i] for i in pos], result.stats)
    groups = split_step(step, idx, prompts, n, np.asarray(rows)[own], mine, deferred)
    done = complete(carried, result, np.flatnonzero(~own))
    return done + [g for g in groups if g.complete], [g for g in groups if not g.complete]


def to_bytes(groups: Sequence[StepGroup]) -> bytes:
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


def from_bytes(data: bytes, source: str) -> list[StepGroup]:
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
        groups.append(StepGroup(int(pid), prompts[p_off:p_off + plen].copy(), tok, lps,
                            [str(f) for f in finish[s_off:s_off + n]], pending[s_off:s_off + n].copy(), int(origin)))
        p_off += plen
        s_off += n
    return groups
