"""Which occurrence in the history to draft from: causal choice rules against hindsight.

Where a run's context matches the prompt's earlier responses at several places, the drafter must
pick whose continuation to draft; ``measure.draft_gap`` finds most of SmolLM2's missed tokens there
(wrong drafts where another history occurrence held the emitted continuation). This module asks
how much of that a causal rule could win. Along each emitted response, every pass drafts the
continuation (at most ``MAX_DRAFT`` tokens, all sent) of one occurrence of the context's longest
suffix match in the history sources (the prompt prepended to each earlier response, as the
history store keeps them), chosen by a rule:

* ``longest``: the first occurrence with the longest match (source order, then position);
* ``count``: among the longest matches, one whose next token is the most common there (the
  suffix tree's count branch at the first step);
* ``nearest``: among the longest matches, the one nearest the row's own position (responses that
  rhyme keep their text at similar offsets);
* ``sticky``: among the longest matches, those in the source the previous pass drafted from, the
  one nearest where that draft had reached; none there: ``nearest`` (follow one earlier response
  through a divergence);
* ``top2``: the better of the two occurrences whose next tokens are the two most common among
  the matches (longest first): what verifying a second draft row per sequence could reach;
* ``hindsight``: the occurrence (any match length >= 1) whose continuation holds the longest run
  of the emitted tokens (the source-bound oracle over the history alone).

Each pass emits the accepted draft tokens and one more, so the passes and the tokens carried by
drafts are a function of the rule. No model runs and no cost model: this ranks choices of
occurrence, not step sizes.

Source: issue 32 (the >= 90%-of-the-bound target); RhymeRL (arXiv 2508.18588) s.4 HistoSpec.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from jaxtyping import Int

from rhyme_jax.rollout.shapes import MAX_DRAFT

RULES = ("longest", "count", "nearest", "sticky", "top2", "hindsight")


def suffix_matches(ctx: Int[np.ndarray, "n"], src: Int[np.ndarray, "m"]) -> Int[np.ndarray, "n+1 m+1"]:
    """``int32[n + 1, m + 1]``: ``L[i, j]`` = length of the longest common suffix of ``ctx[:i]``
    and ``src[:j]`` (dynamic programming, one row per context length)."""
    out = np.zeros((ctx.size + 1, src.size + 1), np.int32)
    for i in range(1, ctx.size + 1):
        out[i, 1:] = np.where(src == ctx[i - 1], out[i - 1, :-1] + 1, 0)
    return out


def _held(src: np.ndarray, j: int, rest: np.ndarray) -> int:
    """Leading tokens of ``rest`` equal to ``src[j:]``."""
    d = src[j: j + rest.size]
    miss = np.flatnonzero(d != rest[: d.size])
    return int(miss[0]) if miss.size else d.size


def _choose(rule: str, cands: list, sources: list, i: int, rest: np.ndarray, prev) -> tuple | None:
    """The occurrence ``(match, source, j)`` the rule drafts from; ``cands``: every occurrence
    ``(match length >= 1, source, continuation start j)`` of the context ``ctx[:i]``."""
    if not cands:
        return None
    if rule == "hindsight":
        return max(cands, key=lambda c: (_held(sources[c[1]], c[2], rest), c[0]))
    top = max(c[0] for c in cands)
    longest = [c for c in cands if c[0] == top]
    same = [c for c in longest if prev is not None and c[1] == prev[0]]
    if rule == "sticky" and same:
        return min(same, key=lambda c: abs(c[2] - prev[1]))
    if rule == "longest":
        return longest[0]
    if rule in ("nearest", "sticky"):
        return min(longest, key=lambda c: abs(c[2] - i))
    counts = Counter(int(sources[c[1]][c[2]]) for c in longest)
    if rule == "count":
        tok = max(counts, key=lambda t: (counts[t], -t))
        return next(c for c in longest if sources[c[1]][c[2]] == tok)
    # top2: the two most common next tokens, longest matches first, then all matches
    counts.update({t: 0 for t in (int(sources[c[1]][c[2]]) for c in cands) if t not in counts})
    two = sorted(counts, key=lambda t: (-counts[t], t))[:2]
    reps = [next(c for c in sorted(cands, key=lambda c: -c[0]) if sources[c[1]][c[2]] == t) for t in two]
    return max(reps, key=lambda c: _held(sources[c[1]], c[2], rest))


def rule_passes(prompt: Int[np.ndarray, "p"], response: Int[np.ndarray, "n"], history: list[np.ndarray],
                rule: str, emitted: int = 1) -> tuple[int, int]:
    """``(sequence passes, tokens carried by accepted drafts)`` of ``response`` after ``emitted``
    tokens (the prefill's) when each pass drafts from the occurrence ``rule`` picks (module
    docstring) in ``history`` (earlier responses; the prompt is prepended to each).

    Raises:
      ValueError: unknown ``rule``.
    """
    if rule not in RULES:
        raise ValueError(f"occurrence rule: expected one of {RULES}, got {rule!r}")
    prompt, response = np.asarray(prompt, np.int64), np.asarray(response, np.int64)
    ctx = np.concatenate([prompt, response])
    sources = [np.concatenate([prompt, np.asarray(h, np.int64)]) for h in history]
    tables = [suffix_matches(ctx, s) for s in sources]
    t, passes, carried, prev = min(emitted, response.size), 0, 0, None
    while t < response.size:
        i = prompt.size + t
        cands = [(int(tab[i, j]), k, int(j)) for k, tab in enumerate(tables)
                 for j in np.flatnonzero(tab[i, : sources[k].size] >= 1)]
        rest = response[t: t + MAX_DRAFT]
        pick = _choose(rule, cands, sources, i, rest, prev)
        acc = 0 if pick is None else _held(sources[pick[1]], pick[2], rest[: max(response.size - t - 1, 0)])
        passes, carried, t = passes + 1, carried + acc, t + acc + 1
        prev = None if pick is None else (pick[1], pick[2] + acc + 1)
    return passes, carried


def rules_step(prompts: dict, pids: Int[np.ndarray, "N"], responses, history, rules=RULES) -> dict:
    """``{rule: {"passes", "carried", "tokens"}}`` summed over one step's rows (``prompts``: prompt
    id -> ``int32[p]``; ``history``: the ``HistoryStore`` as the trainer held it; rows whose
    prompt has no history are skipped)."""
    out = {r: {"passes": 0, "carried": 0, "tokens": 0} for r in rules}
    for p, y in zip(pids, responses):
        if int(p) not in history:
            continue
        hist = history.responses(int(p))[0]
        for r in rules:
            n, c = rule_passes(prompts[int(p)], y, hist, r)
            out[r]["passes"] += n
            out[r]["carried"] += c
            out[r]["tokens"] += int(np.asarray(y).size)
    return out
