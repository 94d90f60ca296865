"""Goodput allocation of draft tokens: each step's draft lengths and step shape.

Given, for each live row, a draft and the estimated probability that each draft token is
accepted given the ones before it (``Drafter.estimates``), the expected tokens a step emits are

    E = rows + sum_i sum_{j < len_i} P[i, j],      P[i, j] = prod_{k <= j} est[i, k]

(every row emits its sampled token plus the accepted prefix of its draft; ``P[i, j]`` is the
probability that draft token j is accepted, i.e. that all tokens up to j are). The step costs
``cost(rows, T, Q)`` seconds for the program ``(T, Q)`` of its row bucket
(``shapes.verify_pairs``; ``(S, 1)`` is plain decode). For every program of the bucket the best
drafts are the ``T - rows`` largest ``P[i, j]`` with ``j < Q - 1`` (``P`` falls along a row, so
the largest values form a prefix of each row's draft); the chosen program maximises ``E / cost``,
expected tokens per second (goodput). Drafting that does not pay is not sent: plain decode wins
whenever no draft adds enough expected tokens to pay for the bigger step. Rows the history predicts
long weigh up to twice as much (``makespan_weights``): the rollout waits for its longest row.
The search covers every row bucket that holds the live rows, not only the smallest: where the
pass-cost model times a small bucket's programs above a larger one's, a tail of few rows runs
padded in the larger bucket.

``DraftBackoff``: while the choice keeps sending no draft although the drafter proposed some
(drafting does not pay in this row bucket: many rows on CPU), the engine skips the drafter and
the choice for 1, 2, 4, ... up to 8 steps, then asks again; a step that sends drafts or a change
of row bucket ends the backoff. Skipped steps are plain decode steps, which is what the choice
made; they save the host time of a draft call and a choice per step.

``fixed_rule`` is the paper policies' step (no estimates): the first program whose ``T`` holds
the rows plus their drafts, a verify program (``Q > 1``) whenever a row drafts, drafts cut to its
``Q - 1``. (Before, the decode program ``(S, 1)`` could take a step whose rows drafted when fewer
rows were live than their bucket, cutting every draft to nothing.) Cutting drafts to the first
program that holds the tokens keeps one long draft from pushing the whole step into the biggest
program.

Source: the issue "goodput-optimal HistoSpec" scope 3; expected accepted length as in
SpecInfer / SuffixDecoding (arXiv 2411.04975); goodput-driven speculation length as in
TurboSpec (Liu et al. 2024, arXiv 2406.14066).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from jaxtyping import Float, Int

from rhyme_jax.rollout.batching import trim_drafts
from rhyme_jax.rollout.shapes import ShapePlan, verify_pairs


@dataclass(frozen=True)
class PassChoice:
    """One decode/verify step's shape and draft lengths.

    Attributes:
      rows: ``S``, the row bucket.
      tokens: ``T``, packed tokens of the program.
      q_len: ``Q``, the program's ``max_q_len`` (drafts are at most ``Q - 1``).
      draft_lens: ``int64[n]`` draft tokens kept per live row.
      expected: expected emitted tokens (``E`` above; ``n`` plus the expected accepted drafts;
        0 when chosen without estimates).
    """

    rows: int
    tokens: int
    q_len: int
    draft_lens: np.ndarray
    expected: float


def accept_curve(estimates: Float[np.ndarray, "n K"], lens: Int[np.ndarray, "n"]) -> Float[np.ndarray, "n K"]:
    """``P[i, j] = prod_{k <= j} estimates[i, k]`` for ``j < lens[i]``, 0 beyond (float64).

    Raises:
      ValueError: ``estimates`` not 2-D with one row per length, or values outside [0, 1].
    """
    est = np.asarray(estimates, np.float64)
    lens = np.asarray(lens, np.int64)
    if est.ndim != 2 or est.shape[0] != lens.shape[0]:
        raise ValueError(f"estimates: expected [n, K] with n = {lens.shape[0]}, got shape {est.shape}")
    if est.size and (not np.all(np.isfinite(est)) or est.min() < 0 or est.max() > 1):
        raise ValueError("estimates: acceptance probabilities must lie in [0, 1]")
    p = np.cumprod(est, axis=1)
    p[np.arange(est.shape[1])[None, :] >= lens[:, None]] = 0.0
    return p


def makespan_weights(priorities: Float[np.ndarray, "n"] | None, n: int) -> Float[np.ndarray, "n"]:
    """Per-row token weights in [1, 2]: ``1 + priorities / max(priorities)`` (the tokens the
    history predicts a row still has to generate; a row predicted to run longest counts its
    tokens double, since it bounds the rollout's batch passes); ones without priorities."""
    if priorities is None:
        return np.ones(n)
    p = np.asarray(priorities, np.float64)
    top = float(p.max(initial=0.0))
    return 1.0 + p / top if top > 0 else np.ones(n)


def goodput_choice(plan: ShapePlan, curve: Float[np.ndarray, "n K"], cost: Callable[[int, int, int], float],
                   weights: Float[np.ndarray, "n"] | None = None) -> PassChoice:
    """The step of ``n`` live rows with acceptance curve ``curve`` (``accept_curve``) that
    maximises expected emitted tokens per second under ``cost(rows, tokens, q_len)``, over the
    programs of every row bucket that holds the ``n`` rows; with
    ``weights`` (``makespan_weights``) row i's expected tokens count ``weights[i]`` times in the
    choice of drafts and program (``PassChoice.expected`` stays unweighted).

    Returns:
      ``PassChoice`` (ties: the smaller program, i.e. plain decode first).
    """
    n = curve.shape[0]
    smallest = plan.bucket(n)
    w = np.ones(n) if weights is None else np.asarray(weights, np.float64)
    # depth-major: entry j * n + i is row i's draft token j, so a stable sort on the score alone
    # takes, within equal scores, the shallower token first (then the lower row)
    flat = np.ascontiguousarray(curve.T).ravel()
    score = np.ascontiguousarray((curve * w[:, None]).T).ravel()
    order = np.flatnonzero(flat > 0)
    order = order[np.argsort(-score[order], kind="stable")]  # largest weighted P first
    depth = order // max(n, 1)
    total_w = float(w.sum())
    prefix: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # q_len -> kept, running sums

    def sums(q_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The tokens a program of ``q_len`` may carry, in order, and the running sums of their
        weighted and unweighted P (one pass per distinct ``q_len``)."""
        if q_len not in prefix:
            kept = order[depth < q_len - 1]
            prefix[q_len] = (kept, np.concatenate([[0.0], np.cumsum(score[kept])]),
                             np.concatenate([[0.0], np.cumsum(flat[kept])]))
        return prefix[q_len]

    best, best_rate = None, -1.0
    # every row bucket that holds the rows: where the pass-cost model times a small bucket's
    # programs above a larger one's (a backend that runs few rows badly), the tail runs padded
    pairs = [(r, t, q) for r in plan.buckets() if r >= smallest
             for t, q in verify_pairs(r, plan.verify_budget)]
    for rows, t_total, q_len in pairs:
        kept, weighted, plain = sums(q_len)
        m = min(t_total - n, kept.size)
        rate = (total_w + float(weighted[m])) / max(cost(rows, t_total, q_len), 1e-12)
        if rate > best_rate * (1 + 1e-9):
            lens = np.bincount(kept[:m] % max(n, 1), minlength=n).astype(np.int64)
            best, best_rate = PassChoice(rows, t_total, q_len, lens, n + float(plain[m])), rate
    return best


def fixed_rule(plan: ShapePlan, draft_lens: Int[np.ndarray, "n"]) -> PassChoice:
    """The step of the paper's window policies (module docstring).

    Raises:
      ValueError: the rows plus drafts exceed the cap of the row bucket.
    """
    lens = np.asarray(draft_lens, np.int64)
    rows = plan.bucket(lens.size)
    used, drafting = lens.size + int(lens.sum()), bool(lens.any())
    pairs = [p for p in verify_pairs(rows, plan.verify_budget) if p[0] >= used and (p[1] > 1 or not drafting)]
    if not pairs:
        raise ValueError(f"step packs {used} tokens, more than the cap of {rows} rows")
    t_total, q_len = pairs[0]
    return PassChoice(rows, t_total, q_len, np.minimum(lens, q_len - 1), 0.0)


def choose_pass(plan: ShapePlan, draft_lens: Int[np.ndarray, "n"], estimates: Float[np.ndarray, "n K"] | None,
                cost: Callable[[int, int, int], float],
                priorities: Float[np.ndarray, "n"] | None = None) -> tuple[PassChoice, np.ndarray | None]:
    """The engine's step for drafts of ``draft_lens`` tokens (already capped by each request's
    budget and ``shapes.MAX_DRAFT``): with ``estimates``, ``goodput_choice`` under ``cost``;
    without, the drafts cut longest-first to the plan's packed-token budget
    (``batching.trim_drafts``) and ``fixed_rule``. ``priorities``: the drafter's predicted
    remaining tokens per row (``makespan_weights``). Returns the choice and the acceptance curve
    (``None`` without estimates)."""
    if estimates is None:
        return fixed_rule(plan, trim_drafts(draft_lens, plan.verify_budget)), None
    curve = accept_curve(np.asarray(estimates)[:, : int(np.max(draft_lens, initial=0))], draft_lens)
    return goodput_choice(plan, curve, cost, makespan_weights(priorities, curve.shape[0])), curve


def expected_accepted(curve: np.ndarray | None, lens: Int[np.ndarray, "n"]) -> float:
    """Expected accepted tokens of drafts of ``lens`` tokens under ``curve`` (0 without one)."""
    if curve is None:
        return 0.0
    return float(curve[np.arange(curve.shape[1])[None, :] < np.asarray(lens)[:, None]].sum())


__all__ = ["PassChoice", "accept_curve", "choose_pass", "expected_accepted", "fixed_rule", "goodput_choice",
           "makespan_weights"]


@dataclass
class DraftBackoff:
    """Exponential backoff of drafting while the goodput choice sends nothing (module docstring).

    Attributes:
      limit: most steps skipped in a row.
      wait: steps still to skip; span: the current skip length; rows: row bucket of the last step.
    """

    limit: int = 8
    wait: int = 0
    span: int = 0
    rows: int = 0

    def skip(self, rows: int) -> bool:
        """Whether the step of a ``rows``-row bucket runs plain decode without drafting."""
        if rows != self.rows:
            self.rows, self.wait, self.span = rows, 0, 0
            return False
        if self.wait > 0:
            self.wait -= 1
            return True
        return False

    def chose(self, proposed: bool, sent: bool) -> None:
        """After a choice: the drafter ``proposed`` drafts, the choice ``sent`` some."""
        if sent:
            self.span = 0
        elif proposed:
            self.span = min(max(1, 2 * self.span), self.limit)
            self.wait = self.span
