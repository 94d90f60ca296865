"""HistoPipe planner: which rollout worker generates which rows of a step (host-side math only).

RhymeRL (arXiv 2508.18588, s.5 "HistoPipe"). A step's batch is P prompts x n
samples; row ``r`` belongs to prompt ``r // n``. From each prompt's predicted length
(``length_predictor.predict_lengths``):

* **Ranking groups** (tier 1): prompts sorted by predicted length (stable: ties by index) and cut
  into G contiguous groups (``np.array_split``); group 0 is the shortest. Groups are of prompts,
  so a prompt's n samples stay together.
* **Order** (tier 1): odd steps place the groups on workers 0, 1, ... ascending (short first),
  even steps descending, so a worker that finished early in one step gets long work in the next.
* **Tier 2**: each group gets ``k_g >= 1`` workers, ``sum k_g <= W``, minimising the makespan
  ``max_g T(len_g, rows per worker)`` over the cost model ``T(tokens, batch)``
  (``cost_model.CostModel``); ``len_g`` is the group's longest predicted length. Exact: binary
  search over the finite set of candidate makespans. When G > W tier 2 does not apply and the
  groups are dealt to workers longest-processing-time first.
* **Exact** (``exact=True``, ``sched.placement: exact``; not in the paper): whole prompts placed to
  the least predicted makespan under ``CostModel.decode_cost`` (``exact_placement.best_subsets``,
  dynamic programming over subsets of at most 12 prompts) in place of both tiers. Where a pass
  costs many row-passes (the CPU) the tiers can lose to fifo (ledger task: 0.96x replayed) while
  this placement, from the same history, reached 1.17x (docs/results.md, L5).
* **Spread** (``spread=True``, ``sched.placement: spread``): every prompt's samples dealt over all
  the workers, longest predicted prompts first (``spread_placement``): tier 2's "more workers for
  long groups" at its limit, for steps whose makespan is one prompt's long samples stacked on one
  worker.
* **fifo** (``mode="fifo"``): the prompts split over the workers in order
  (``np.array_split``), no history: what ``parallel.distributed.process_groups`` does for one
  process.

Each switch works alone (ablations): ``tier1=False`` keeps fifo chunks as the groups (group ids in
index order, no sorting, no parity order) but tier 2 still sizes them; ``tier2=False`` spreads the
workers as evenly as possible over the groups, in placement order.

Splitting a group over its k workers (``split_group``): when the group has at least k prompts,
whole prompts are dealt round-robin in descending predicted length (tier 1 on; contiguous
``np.array_split`` when tier 1 is off), so worker row counts differ by at most n and a prompt's
rows stay on one worker. When it has fewer than k prompts, its rows (prompt-contiguous) are cut
into k contiguous chunks (sample level; row counts differ by at most 1 and each worker's rows of a
prompt are contiguous). ``max_worker_rows`` gives the resulting largest per-worker batch, which is
the batch tier 2 costs a group at.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from jaxtyping import Float, Int

from rhyme_jax.sched.cost_model import CostModel
from rhyme_jax.sched.exact_placement import MAX_PROMPTS, best_subsets, prompts_of
from rhyme_jax.sched.spread_placement import rows_of, spread_counts

MODES = ("histopipe", "fifo")


@dataclass(frozen=True)
class Plan:
    """One step's assignment of rows to rollout workers.

    Attributes:
      step: GRPO step the plan is for (its parity sets the tier-1 order).
      mode: ``"histopipe"`` or ``"fifo"``.
      n: samples per prompt (rows per prompt).
      groups: prompt indices of each group (group id = position); ranking groups (shortest first)
        with tier 1, fifo chunks otherwise.
      order: group ids in placement order: workers are handed out to ``order[0]`` first.
      ascending: tier-1 direction of this step (True on odd steps); None without tier 1.
      group_workers: ``int64[G]`` workers per group (0 for groups dealt LPT when G > W: see
        ``worker_groups``).
      worker_rows: per worker, ``int64`` row indices (every row of the step exactly once over all
        workers; a prompt's rows contiguous within a worker; empty for an idle worker).
      worker_groups: per worker, the group ids it runs (one unless G > W; empty when idle).
      predicted_seconds: ``float64[W]`` ``T(longest predicted length of its prompts, its rows)``.
    """

    step: int
    mode: str
    n: int
    groups: list[np.ndarray]
    order: list[int]
    ascending: bool | None
    group_workers: np.ndarray
    worker_rows: list[np.ndarray]
    worker_groups: list[tuple[int, ...]]
    predicted_seconds: np.ndarray
    notes: list[str] = field(default_factory=list)

    @property
    def num_workers(self) -> int:
        return len(self.worker_rows)

    @property
    def worker_group(self) -> list[int]:
        """Group id per worker (its first group when it holds several; -1 when idle)."""
        return [g[0] if g else -1 for g in self.worker_groups]

    @property
    def predicted_makespan(self) -> float:
        """Predicted seconds of the slowest worker."""
        return float(self.predicted_seconds.max()) if self.predicted_seconds.size else 0.0


def step_ascending(step: int) -> bool:
    """Tier-1 direction: odd steps ascending (short groups first), even steps descending."""
    return int(step) % 2 == 1


def ranking_groups(pred: Float[np.ndarray, "P"], num_groups: int) -> list[np.ndarray]:
    """Ranking groups: prompt indices sorted by predicted length (stable, ties by index) and split
    into ``min(num_groups, P)`` contiguous groups with ``np.array_split`` (shortest group first).

    Raises:
      ValueError: ``num_groups`` < 1 or ``pred`` not 1-D.
    """
    pred = np.asarray(pred, dtype=np.float64)
    if pred.ndim != 1:
        raise ValueError(f"pred: expected float[P], got shape {pred.shape}")
    if num_groups < 1:
        raise ValueError(f"num_groups: expected >= 1, got {num_groups}")
    order = np.argsort(pred, kind="stable")
    return [g.astype(np.int64) for g in np.array_split(order, min(num_groups, max(pred.size, 1)))]


def fifo_groups(num_prompts: int, num_groups: int) -> list[np.ndarray]:
    """Prompt indices ``0..P-1`` in order, split into ``num_groups`` chunks (``np.array_split``)."""
    return [g.astype(np.int64) for g in np.array_split(np.arange(num_prompts), num_groups)]


def max_worker_rows(num_prompts: int, n: int, k: int) -> int:
    """Largest per-worker row count when a group of ``num_prompts`` prompts x ``n`` samples is split
    over ``k`` workers by ``split_group``: ``ceil(P/k) * n`` at prompt level (``k <= P``), else
    ``ceil(P*n/k)`` at sample level."""
    if k <= num_prompts:
        return -(-num_prompts // k) * n
    return -(-(num_prompts * n) // k)


def _group_cost(cost: CostModel, length: float, prompts: int, n: int, k: int) -> float:
    return float(cost.seconds(length, max_worker_rows(prompts, n, k)))


def allocate_workers(
    group_prompts: Int[np.ndarray, "G"],
    group_lens: Float[np.ndarray, "G"],
    num_workers: int,
    cost_model: CostModel,
    n: int,
) -> Int[np.ndarray, "G"]:
    """Tier 2: workers per ranking group minimising the makespan.

    Minimises ``max_g T(group_lens[g], max_worker_rows(group_prompts[g], n, k_g))`` subject to
    ``k_g >= 1``, ``k_g <= group_prompts[g] * n`` (a worker needs a row) and ``sum k_g <= W``.
    The cost of a group is non-increasing in ``k``, so a makespan M is feasible iff the least
    ``k_g`` meeting M sum to at most W; binary search over the sorted candidate values
    ``T(len_g, rows(k))`` (k = 1..W) finds the optimum exactly. Workers left over are then given,
    one at a time, to the costliest group whose cost they lower (the makespan never rises; this
    spreads slack onto the likeliest stragglers).

    Args:
      group_prompts: ``int[G]`` prompts per group (>= 1 each).
      group_lens: ``float[G]`` longest predicted length per group (tokens).
      num_workers: W >= G.
      cost_model: ``T(tokens, batch)`` in seconds.
      n: samples per prompt.

    Returns:
      ``int64[G]`` workers per group.

    Raises:
      ValueError: G > W (tier 2 is not applicable: deal groups LPT instead), G == 0, or a group
        without prompts.
    """
    prompts = np.asarray(group_prompts, dtype=np.int64)
    lens = np.asarray(group_lens, dtype=np.float64)
    G, W = prompts.size, int(num_workers)
    if G == 0 or lens.shape != prompts.shape:
        raise ValueError(f"allocate_workers: need G >= 1 groups with a length each, got {G} and {lens.shape}")
    if G > W:
        raise ValueError(f"allocate_workers: {G} groups > {W} workers; tier 2 needs G <= W")
    if prompts.min() < 1:
        raise ValueError("allocate_workers: every group needs at least one prompt")
    caps = np.minimum(W - (G - 1), prompts * n)
    costs = [np.array([_group_cost(cost_model, lens[g], prompts[g], n, k) for k in range(1, caps[g] + 1)])
             for g in range(G)]

    def least_k(M: float) -> np.ndarray | None:
        ks = np.empty(G, dtype=np.int64)
        for g in range(G):
            ok = np.nonzero(costs[g] <= M)[0]
            if ok.size == 0:
                return None
            ks[g] = ok[0] + 1
        return ks if ks.sum() <= W else None

    cand = np.unique(np.concatenate(costs))
    lo, hi = 0, cand.size - 1  # cand[hi] = max_g T(g, 1) is feasible (all k_g = 1, G <= W)
    while lo < hi:
        mid = (lo + hi) // 2
        if least_k(cand[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    ks = least_k(cand[lo])
    while ks.sum() < W:
        cur = np.array([costs[g][ks[g] - 1] for g in range(G)])
        for g in np.argsort(-cur, kind="stable"):
            if ks[g] < caps[g] and costs[g][ks[g]] < cur[g]:
                ks[g] += 1
                break
        else:
            break
    return ks


def _lpt(costs: np.ndarray, order: list[int], num_workers: int) -> list[list[int]]:
    """Longest-processing-time first: groups by cost descending (ties by placement order) onto the
    least-loaded worker (ties by lowest index); each worker's groups in placement order."""
    rank = {g: i for i, g in enumerate(order)}
    load = np.zeros(num_workers)
    out: list[list[int]] = [[] for _ in range(num_workers)]
    for g in sorted(order, key=lambda g: (-costs[g], rank[g])):
        w = int(np.argmin(load))
        out[w].append(g)
        load[w] += costs[g]
    return [sorted(gs, key=rank.__getitem__) for gs in out]


def _rows(prompts: np.ndarray, n: int) -> np.ndarray:
    return (prompts[:, None] * n + np.arange(n)[None, :]).reshape(-1).astype(np.int64)


def split_group(prompts: np.ndarray, pred: np.ndarray, n: int, k: int, balance: bool) -> list[np.ndarray]:
    """Rows of a group's prompts split over ``k`` workers (see the module docstring).

    Args:
      prompts: ``int[Pg]`` prompt indices of the group (its order).
      pred: ``float[P]`` predicted lengths of all prompts of the step.
      n: samples per prompt.
      k: workers (>= 1).
      balance: deal whole prompts round-robin by descending predicted length (else contiguous).

    Returns:
      k ``int64`` row arrays; each worker's prompts in ascending prompt index.
    """
    prompts = np.asarray(prompts, dtype=np.int64)
    if k <= prompts.size:
        if balance:
            by_len = prompts[np.argsort(-pred[prompts], kind="stable")]
            parts = [np.sort(by_len[j::k]) for j in range(k)]
        else:
            parts = np.array_split(prompts, k)
        return [_rows(p, n) for p in parts]
    return [r.astype(np.int64) for r in np.array_split(_rows(prompts, n), k)]


def _check(pred, n, num_workers, mode, num_groups) -> np.ndarray:
    if mode not in MODES:
        raise ValueError(f"sched.mode: expected one of {list(MODES)}, got {mode!r}")
    pred = np.asarray(pred, dtype=np.float64)
    if pred.ndim != 1 or pred.size == 0 or not np.all(np.isfinite(pred)) or np.any(pred < 0):
        raise ValueError(f"pred: expected finite float[P] >= 0 with P >= 1, got {pred.dtype}{pred.shape}")
    if int(n) != n or n < 1:
        raise ValueError(f"n: expected samples per prompt >= 1, got {n!r}")
    if int(num_workers) != num_workers or num_workers < 1:
        raise ValueError(f"num_workers: expected >= 1, got {num_workers!r}")
    if int(num_groups) != num_groups or num_groups < 0:
        raise ValueError(f"sched.num_groups: expected >= 0 (0 = auto), got {num_groups!r}")
    return pred


def plan_step(
    step: int,
    pred: Float[np.ndarray, "P"],
    n: int,
    num_workers: int,
    cost_model: CostModel,
    *,
    mode: str = "histopipe",
    tier1: bool = True,
    tier2: bool = True,
    num_groups: int = 0,
    exact: bool = False,
    spread: bool = False,
) -> Plan:
    """Plan one step: rows (P prompts x n samples, row r of prompt r // n) onto W workers.

    Args:
      step: GRPO step (odd = ascending tier-1 order).
      pred: ``float64[P]`` predicted length per prompt (tokens).
      n: samples per prompt.
      num_workers: W rollout workers.
      cost_model: ``T(tokens, batch)`` seconds per worker (tier 2 and ``predicted_seconds``).
      mode: ``"histopipe"`` or ``"fifo"`` (the tier switches are ignored in fifo).
      tier1: sort into ranking groups and alternate the order by step parity.
      tier2: size the groups' worker counts by the cost model (LPT dealing when G > W).
      num_groups: G; 0 = auto ``max(1, W // 2)``; capped at P.
      exact: histopipe places whole prompts by ``exact_placement.best_subsets`` on ``pred`` (the
        least predicted makespan; the tier switches are then unused) when P <= its
        ``MAX_PROMPTS``, the tiers otherwise (a note says so).
      spread: histopipe deals every prompt's samples over all workers (``spread_placement``; the
        tier switches and ``exact`` are then unused).

    Returns:
      A ``Plan`` (every row exactly once over ``worker_rows``).

    Raises:
      ValueError: unknown mode (names ``sched.mode``), bad ``pred``/``n``/``num_workers``/
        ``num_groups``.
    """
    pred = _check(pred, n, num_workers, mode, num_groups)
    P, W, n = pred.size, int(num_workers), int(n)
    if mode == "fifo":
        groups = fifo_groups(P, W)
        rows = [_rows(g, n) for g in groups]
        return _finish(step, mode, n, groups, list(range(W)), None,
                       np.array([int(g.size > 0) for g in groups], np.int64), rows,
                       [(w,) if g.size else () for w, g in enumerate(groups)], pred, cost_model, [])

    notes: list[str] = []
    if spread:
        return _spread(step, pred, n, W, cost_model)
    if exact and P <= MAX_PROMPTS:
        return _exact(step, pred, n, W, cost_model)
    if exact:
        notes.append(f"exact placement: {P} prompts > {MAX_PROMPTS}, tiers used")
    G = min(num_groups or max(1, W // 2), P)
    if tier1:
        groups, ascending = ranking_groups(pred, G), step_ascending(step)
        order = list(range(G)) if ascending else list(range(G - 1, -1, -1))
    else:
        groups, ascending, order = fifo_groups(P, G), None, list(range(G))
    glens = np.array([pred[g].max() for g in groups])
    gprompts = np.array([g.size for g in groups], dtype=np.int64)
    if G <= W:
        k, worker_rows, worker_groups = _spread_groups(groups, order, glens, gprompts, pred, n, W, cost_model,
                                                       tier1=tier1, tier2=tier2)
    else:
        k, worker_rows, worker_groups = _deal_groups(groups, order, glens, gprompts, n, W, cost_model,
                                                     tier2=tier2, notes=notes)
    return _finish(step, mode, n, groups, order, ascending, k, worker_rows, worker_groups, pred,
                   cost_model, notes)


def _spread_groups(groups, order, glens, gprompts, pred, n, W, cost_model, *, tier1: bool, tier2: bool):
    """G <= W ranking groups over W workers: ``k[g]`` workers each (tier 2: by the cost model;
    else an even share), the group's rows split over them (``split_group``); workers left without
    work get no rows. Returns ``(k int64[G], worker_rows, worker_groups)``."""
    G = len(groups)
    if tier2:
        k = allocate_workers(gprompts, glens, W, cost_model, n)
    else:
        k = np.zeros(G, np.int64)
        for i, g in enumerate(order):
            k[g] = W // G + (1 if i < W % G else 0)
        k = np.minimum(k, gprompts * n)  # a worker needs at least one row
    worker_rows: list[np.ndarray] = []
    worker_groups: list[tuple[int, ...]] = []
    for g in order:
        for part in split_group(groups[g], pred, n, int(k[g]), balance=tier1):
            worker_rows.append(part)
            worker_groups.append((g,))
    while len(worker_rows) < W:  # workers tier 2 left without work
        worker_rows.append(np.zeros(0, np.int64))
        worker_groups.append(())
    return k, worker_rows, worker_groups


def _deal_groups(groups, order, glens, gprompts, n, W, cost_model, *, tier2: bool, notes: list[str]):
    """G > W ranking groups dealt whole to W workers (tier 2: longest processing time first, a
    note appended to ``notes``; else contiguous runs of ``order``). Returns ``(k int64[G] (zeros),
    worker_rows, worker_groups)``."""
    G = len(groups)
    k = np.zeros(G, np.int64)
    if tier2:
        costs = np.array([_group_cost(cost_model, glens[g], gprompts[g], n, 1) for g in range(G)])
        dealt = _lpt(costs, order, W)
        notes.append(f"G={G} > W={W}: tier 2 not applicable, groups dealt longest-processing-time first")
    else:
        dealt = [list(c) for c in np.array_split(np.array(order, dtype=np.int64), W)]
    worker_rows: list[np.ndarray] = []
    worker_groups: list[tuple[int, ...]] = []
    for gs in dealt:
        gs = [int(g) for g in gs]
        worker_rows.append(np.concatenate([_rows(groups[g], n) for g in gs]) if gs else np.zeros(0, np.int64))
        worker_groups.append(tuple(gs))
    return k, worker_rows, worker_groups


def _exact(step: int, pred: np.ndarray, n: int, W: int, cost_model: CostModel) -> Plan:
    """The exact whole-prompt placement (``exact_placement``): one group per worker used, in worker
    order; the workers it leaves idle get no rows."""
    _, masks = best_subsets(np.repeat(pred[:, None], n, axis=1), cost_model, W)
    groups = [prompts_of(m, pred.size) for m in masks]
    rows = [_rows(g, n) for g in groups] + [np.zeros(0, np.int64)] * (W - len(groups))
    wgroups = [(g,) for g in range(len(groups))] + [()] * (W - len(groups))
    return _finish(step, "histopipe", n, groups, list(range(len(groups))), None, np.ones(len(groups), np.int64),
                   rows, wgroups, pred, cost_model, ["exact placement"])


def _spread(step: int, pred: np.ndarray, n: int, W: int, cost_model: CostModel) -> Plan:
    """The sample-level spread (``spread_placement``): one group per prompt, in dealing order; a
    worker's groups are the prompts it holds samples of."""
    counts = spread_counts(pred, n, W)
    return _finish(step, "histopipe", n, [np.array([p], np.int64) for p in range(pred.size)],
                   np.argsort(-pred, kind="stable").tolist(), None, (counts > 0).sum(axis=0).astype(np.int64),
                   rows_of(counts, n), [tuple(np.flatnonzero(c).tolist()) for c in counts], pred, cost_model,
                   ["spread placement"])


def _finish(step, mode, n, groups, order, ascending, k, worker_rows, worker_groups, pred,
            cost_model, notes) -> Plan:
    secs = np.zeros(len(worker_rows))
    for w, r in enumerate(worker_rows):
        if r.size:
            secs[w] = cost_model.seconds(pred[np.unique(r // n)].max(), r.size)
    return Plan(int(step), mode, n, groups, order, ascending, np.asarray(k, dtype=np.int64),
                worker_rows, worker_groups, secs, notes)


def rows_per_worker(plan: Plan) -> np.ndarray:
    """``int64[W]`` row counts of a plan's workers."""
    return np.array([r.size for r in plan.worker_rows], dtype=np.int64)


def check_plan(plan: Plan, num_prompts: int) -> None:
    """Check a plan's invariants: every row ``0..P*n-1`` exactly once over the workers, and a
    prompt's rows on a single worker unless its group was split at sample level (fewer prompts
    than workers).

    Raises:
      ValueError: naming the broken invariant.
    """
    allr = np.concatenate(plan.worker_rows) if plan.worker_rows else np.zeros(0, np.int64)
    if not np.array_equal(np.sort(allr), np.arange(num_prompts * plan.n)):
        raise ValueError("plan: rows are not each assigned exactly once")
    owners: dict[int, set[int]] = {}
    for w, r in enumerate(plan.worker_rows):
        for p in np.unique(r // plan.n).tolist():
            owners.setdefault(p, set()).add(w)
    for g, gp in enumerate(plan.groups):
        if gp.size >= plan.group_workers[g]:  # prompt-level split (or LPT/fifo dealing: k = 0/1)
            split = [p for p in gp.tolist() if len(owners.get(p, ())) != 1]
            if split:
                raise ValueError(f"plan: prompts {split} of group {g} are not on exactly one worker")
