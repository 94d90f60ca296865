"""The one drafter replay loop: a drafter drafting along target tokens known beforehand.

Given the tokens a sequence emits, the verify passes a drafter's drafts take are fixed: a draft
token is accepted exactly when it equals the target's next token (lossless verification of a
one-hot draft ``x`` accepts with probability ``p(x)`` and otherwise emits a token of ``p`` with
``x`` removed, which is how a token drawn from ``p`` relates to ``x``), and each pass emits the
accepted prefix plus one token. ``drive`` walks a group of targets live together through those
passes with any ``DraftBatch`` (``rhyme_jax.spec.drafter``, the oracles of
``measure.oracle_drafters``); what a pass sends is either every drafted token (``send=None``: the
pass replay of ``measure.pass_replay``, the drafting-time benchmark) or the engine's step choice
(``EnginePasses``: ``allocation.choose_pass`` under a pass-cost model, or ``floor_pass``).
``replay_targets`` replays a whole list of targets ``rows`` at a time with the engine's choice:
``python -m rhyme_lab replay-drafts`` (``measure.text_replay``), the HistoSpec ablations
(``ablate.replay``) and ``benchmarks.replay_bound`` count with it. Pages are not simulated.

Source: RhymeRL (arXiv 2508.18588) s.4 HistoSpec; issues 4, 16 and "goodput-optimal HistoSpec".
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from jaxtyping import Float, Int

from rhyme_jax.rollout import allocation, shapes


def tails(prompts: list[np.ndarray], targets: list[np.ndarray], reqs: Int[np.ndarray, "n"],
          done: Int[np.ndarray, "N"], width: int) -> Int[np.ndarray, "n width"]:
    """``int32[n, width]``: the last ``width`` tokens of prompt + target so far of each row of
    ``reqs`` (indices into ``prompts`` / ``targets``; ``done[r]`` target tokens emitted), left
    padded with -1 (the drafter's context)."""
    out = np.full((len(reqs), width), -1, np.int32)
    for i, r in enumerate(reqs):
        seq = np.concatenate([prompts[r], targets[r][: done[r]]])[-width:]
        out[i, width - seq.size:] = seq
    return out


def accepted_prefix(drafts: Int[np.ndarray, "n K"], lens: Int[np.ndarray, "n"], targets: list[np.ndarray],
                    reqs: Int[np.ndarray, "n"], done: Int[np.ndarray, "N"]) -> Int[np.ndarray, "n"]:
    """``int64[n]``: leading tokens of each row's draft (its first ``lens[i]``) equal to the
    target's next tokens (at most the tokens left)."""
    out = np.zeros(len(reqs), np.int64)
    for i, r in enumerate(reqs):
        want = targets[r][done[r]: done[r] + int(lens[i])]
        match = np.asarray(drafts[i, : want.size]) == want
        out[i] = want.size if match.all() else int(np.argmin(match))
    return out


def drive(batch, prompts: list[np.ndarray], targets: list[np.ndarray], *, emitted: int = 0,
          max_new: int | None = None, send: Callable | None = None, tally: "Tally | None" = None,
          rebatch: Callable | None = None) -> Int[np.ndarray, "n"]:
    """Draft along the targets (live together) until every one is emitted.

    Args:
      batch: a ``DraftBatch`` (``context_width``, ``draft(reqs, tails, budgets) -> (int32[n, K],
        int[n])``, ``observe(reqs, lens, accepted)``) whose row ``i`` is ``targets[i]``.
      prompts, targets: ``int32[p_i]`` prompt and ``int32[t_i]`` target tokens per row.
      emitted: target tokens emitted before the first pass (1: a prefill sampled the first).
      max_new: the rollout's ``max_new_tokens``: each budget is ``max_new - emitted - 1`` (the
        engine's); ``None``: the tokens left - 1.
      send: ``send(batch, lens, left) -> int64[n]``, the draft tokens the pass sends (``EnginePasses``);
        ``None``: every drafted token.
      tally: adds each pass's figures (``Tally.add``).
      rebatch: ``rebatch(reqs, lens, accepted, done)`` after each pass; a batch it returns
        replaces ``batch`` (``measure.pass_replay``'s siblings).

    Returns ``int64[n]`` passes per row.
    """
    size = np.array([t.size for t in targets], np.int64)
    done = np.minimum(emitted, size)
    passes = np.zeros(size.size, np.int64)
    while True:
        reqs = np.flatnonzero(done < size)
        if not reqs.size:
            return passes
        left = size[reqs] - done[reqs]
        budgets = np.maximum(left - 1, 0) if max_new is None else max_new - done[reqs] - 1
        drafts, lens = batch.draft(reqs, tails(prompts, targets, reqs, done, batch.context_width), budgets)
        lens = np.asarray(lens, np.int64)
        if send is not None:
            lens = send(batch, np.minimum(np.minimum(lens, budgets), shapes.MAX_DRAFT), left)
        accepted = accepted_prefix(drafts, lens, targets, reqs, done)
        done[reqs] += np.minimum(accepted + 1, left)
        passes[reqs] += 1
        batch.observe(reqs, lens, accepted)
        if tally is not None:
            tally.add(left, lens, accepted)
        if rebatch is not None:
            batch = rebatch(reqs, lens, accepted, done) or batch


class Tally:
    """Pass figures summed over ``drive`` calls: ``passes`` (sequence passes), ``eligible``
    (passes with room for a draft), ``hits`` (passes that sent one), ``drafted`` / ``accepted``
    tokens and ``draft_hist`` (``int64[MAX_DRAFT + 1]`` passes per sent draft length)."""

    def __init__(self):
        self.passes = self.eligible = self.hits = self.drafted = self.accepted = 0
        self.draft_hist = np.zeros(shapes.MAX_DRAFT + 1, np.int64)

    def add(self, left: Int[np.ndarray, "n"], lens: Int[np.ndarray, "n"], accepted: Int[np.ndarray, "n"]) -> None:
        """One pass of ``left.size`` rows (``left``: target tokens each had left before it)."""
        self.passes += int(left.size)
        self.eligible += int((left > 1).sum())
        self.hits += int((lens > 0).sum())
        self.drafted += int(lens.sum())
        self.accepted += int(accepted.sum())
        self.draft_hist += np.bincount(lens, minlength=shapes.MAX_DRAFT + 1)[: shapes.MAX_DRAFT + 1]


def floor_pass(lens: Int[np.ndarray, "n"], estimates: Float[np.ndarray, "n K"] | None, floor: float, rows: int):
    """The unshaped step of ``--accept-floor``: row i sends its first ``d_i`` draft tokens, those
    whose cumulative acceptance estimate ``prod_{k <= j} estimates[i, k]`` is at least ``floor``
    (a prefix: the product only falls). ``lens int64[n]``: the drafts' lengths; ``estimates
    float32[n, K]``: the goodput drafter's; ``rows``: the step's row bucket (what the step
    costs). Returns ``(PassChoice, curve)`` as ``allocation.choose_pass`` (tokens = rows + sum d,
    the n rows' exact packed tokens plus the bucket's padding rows; q_len = 1 + max d).

    Raises:
      ValueError: no estimates (the drafter is not ``spec.window=goodput``).
    """
    if estimates is None:
        raise ValueError("--accept-floor needs the goodput drafter's estimates (spec.window=goodput)")
    curve = allocation.accept_curve(np.asarray(estimates)[:, : int(np.max(lens, initial=0))], lens)
    take = (curve >= floor) & (curve > 0)  # the curve is 0 past each draft's length
    sent = take.sum(axis=1).astype(np.int64)
    return allocation.PassChoice(rows, rows + int(sent.sum()), 1 + int(sent.max(initial=0)), sent,
                                 lens.size + float(curve[take].sum())), curve


class EnginePasses:
    """``drive``'s ``send``: the engine's step for the pass's drafts (``allocation.choose_pass``
    with the batch's ``estimates`` / ``priorities`` under ``cost``; with ``floor``, ``floor_pass``
    in the row bucket of ``plan``). Sums ``seconds`` (the chosen steps under ``cost``: seconds of a
    profile, units of the prior) and ``predicted`` (expected accepted tokens under the estimates)."""

    def __init__(self, plan, cost: Callable[[int, int, int], float], floor: float | None = None):
        self.plan, self.cost, self.floor = plan, cost, floor
        self.seconds = self.predicted = 0.0

    def __call__(self, batch, lens: Int[np.ndarray, "n"], left: Int[np.ndarray, "n"]) -> Int[np.ndarray, "n"]:
        """``int64[n]`` draft tokens sent of ``lens`` (already capped by budget and ``MAX_DRAFT``)."""
        estimates = getattr(batch, "estimates", None)
        if self.floor is None:
            choice, curve = allocation.choose_pass(self.plan, lens, estimates, self.cost,
                                                   getattr(batch, "priorities", None))
        else:
            choice, curve = floor_pass(lens, estimates, self.floor, self.plan.bucket(lens.size))
        self.predicted += allocation.expected_accepted(curve, choice.draft_lens)
        self.seconds += self.cost(choice.rows, choice.tokens, choice.q_len)
        return np.asarray(choice.draft_lens, np.int64)


def plain_seconds(lengths: list[int], plan, cost: Callable[[int, int, int], float]) -> float:
    """Modelled seconds of plain decode (one token per row per step) of targets of ``lengths``
    tokens live together, each step in its row bucket of ``plan``."""
    lengths = np.sort(np.asarray(lengths))
    total, prev = 0.0, 0
    for i, n in enumerate(lengths):
        rows = plan.bucket(lengths.size - i)
        total += (int(n) - prev) * cost(rows, rows, 1)
        prev = int(n)
    return total


def replay_targets(drafter, prompts: list[np.ndarray], targets: list[np.ndarray], pids: list[int], plan,
                   rows: int, cost: Callable[[int, int, int], float],
                   floor: float | None = None) -> tuple[Tally, EnginePasses, float]:
    """Draft along every target, ``rows`` consecutive targets live at a time (one
    ``drafter.batch(pids of the group)`` each), each pass sized by ``EnginePasses(plan, cost,
    floor)``. ``prompts`` / ``targets``: ``int32`` tokens per target; ``pids``: its prompt id.
    Returns the pass ``Tally``, the ``EnginePasses`` (modelled seconds, predicted acceptances) and
    plain decode's modelled seconds of the same groups."""
    tally, steps, plain = Tally(), EnginePasses(plan, cost, floor), 0.0
    for start in range(0, len(targets), rows):
        group = slice(start, min(start + rows, len(targets)))
        drive(drafter.batch(list(pids[group])), prompts[group], targets[group], send=steps, tally=tally)
        plain += plain_seconds([t.size for t in targets[group]], plan, cost)
    return tally, steps, plain
