"""The oracle's rollout bound on a recorded run, under the run's pass-cost profile.

Given the tokens each sequence of a step emitted, an oracle drafter that sends, at every pass,
exactly the longest continuation that a draft source holds (the prompt's previous rollout, the
same step's other responses of the prompt, the sequence itself: ``measure.pass_replay.
oracle_accepts``) gets all
of it accepted, and nothing faster is possible through these sources. Its passes are replayed
batch-wise (all rows start together after one prefill; a pass packs ``1 + accepted`` tokens per
live row, the widest row sets ``max_q_len``), and each pass is priced with the pass-cost model of
the engine (``rollout.pass_cost.PassCost``: the goodput run's profile, its live medians where it
has them). The oracle may cap its drafts at ``w`` tokens; the bound takes the fastest of
``WINDOWS`` and of plain decode, so it is never below 1.

Per step the bound is the measured plain rollout seconds over the same seconds with their
modelled decode passes replaced by the oracle's (prefill and host time kept):
``plain_s / (plain_s - p + p * model(oracle) / model(plain))`` with ``p = min(model(plain),
plain_s)`` (a model that prices the passes above the measured rollout is scaled down to it, so
the bound is never below 1); without a profile (the prior's units are not seconds) it is
``model(plain) / model(oracle)``. Ignored: preemption, page limits, the verify
token budget and the program buckets (rows and tokens are priced as they are).

Source: the issue "speed where training really happens" (scope 1, the oracle bound); the exact
pass replay of ``rhyme_lab.measure.pass_replay``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rhyme_lab.measure.pass_replay import oracle_accepts
from rhyme_jax.rollout.pass_cost import PassCost, bucket_scales

WINDOWS = (2, 4, 8, 32)  # draft caps the oracle may choose from (32 = MAX_DRAFT)
PATTERN = (7, 1)  # longest / shortest context suffix matched (the goodput drafter's pattern_min 1)


def batch_cost(per_row: list[list[int]], cost: PassCost) -> float:
    """Modelled seconds of the verify/decode passes of rows that start together: pass ``j``
    runs the rows with a ``j``-th pass, ``1 + accepted`` tokens each (plain decode: all zeros)."""
    total, j = 0.0, 0
    while True:
        live = [r[j] for r in per_row if j < len(r)]
        if not live:
            return total
        total += cost(len(live), len(live) + sum(live), 1 + max(live))
        j += 1


def step_bound(prompts: list[np.ndarray], responses: list[np.ndarray], sources: list[list[np.ndarray]],
               cost: PassCost, max_new: int) -> tuple[float, float]:
    """``(model(plain), model(oracle))`` of one step (module docstring): the oracle's fastest
    window, plain decode included. ``prompts`` / ``responses``: ``int32`` tokens per row;
    ``sources``: each row's draft sources; ``max_new``: ``rollout.max_new_tokens``."""
    plain = batch_cost([[0] * max(0, len(y) - 1) for y in responses], cost)
    best = plain
    for w in WINDOWS:
        rows = [oracle_accepts(p, y, s, w, PATTERN, max_new) for p, y, s in zip(prompts, responses, sources)]
        best = min(best, batch_cost(rows, cost))
    return plain, best


def cost_model(rows: dict) -> tuple[PassCost, bool]:
    """A ``PassCost`` from a unit's ``step_cost`` JSON (``ablate.e2e.pass_cost_rows``): live
    medians over profiled seconds, and the profiled programs without a live median scaled by their
    row bucket's median live / profiled ratio (as the engine's ``PassCost.observe`` does).
    Returns ``(model, in_seconds)``; no rows: the prior (not seconds)."""
    seconds = {(int(r), int(t), int(q)): float(s) for r, t, q, s in rows.get("profiled", [])}
    by_program: dict = {}  # live rows are [rows, tokens, q, s] or, per page-table width, [rows, tokens, q, width, s]
    for x in rows.get("live", []):
        by_program.setdefault(tuple(int(v) for v in x[:3]), []).append(float(x[-1]))
    live = {k: float(np.median(v)) for k, v in by_program.items()}  # the widths the run saw, pooled
    scales = bucket_scales(seconds, live)
    seconds = {k: s * scales.get(k[0], 1.0) for k, s in seconds.items()}
    seconds.update(live)
    return (PassCost(seconds, dict(rows.get("meta", {}))), True) if seconds else (PassCost.prior(), False)


def _step_inputs(run_dir: Path, step: int, history, prompt_of, siblings: bool = True) -> tuple:
    """Prompts, responses and draft sources (history, and with ``siblings`` the same step's other
    responses of the prompt) of one saved step."""
    from rhyme_jax.io.rollout_log import load_rollouts

    ro = load_rollouts(run_dir, step)
    pids, resp = ro["prompt_ids"], ro["responses"]
    prompts = [prompt_of(int(p)) for p in pids]
    sources = []
    for i, p in enumerate(pids):
        hist = history.responses(int(p))[0] if int(p) in history else []
        sib = [resp[j] for j in np.flatnonzero(pids == p) if j != i] if siblings else []
        sources.append([np.concatenate([prompts[i], h]) for h in [*hist, *sib]])
    return ro, prompts, sources


def with_oracle_passes(measured: float, plain: float, oracle: float) -> float:
    """Seconds of a plain rollout that took ``measured`` seconds with its decode passes, modelled
    at ``plain``, replaced by the oracle's, modelled at ``oracle`` (module docstring): the passes
    count as ``p = min(plain, measured)`` seconds (a model that prices them above the measured
    rollout is scaled down to it, so the result is never above ``measured`` while ``oracle <=
    plain``) and become ``p * oracle / plain``."""
    passes = min(plain, measured)
    return measured - passes + (passes * oracle / plain if plain > 0 else 0.0)


def epoch_bounds(plain_unit: dict, cost_rows: dict, siblings: bool = True) -> dict[int, float]:
    """The oracle bound per epoch over the timed steps of a plain GRPO unit (``ablate.e2e``):
    ``sum(plain_s) / sum(plain_s - p + p * model(oracle) / model(plain))`` (module docstring).
    ``siblings``: the same step's other responses of a prompt count as sources from the start of
    the step (an over-estimate for rows that finish together); without them the sources are the
    previous rollout and the sequence itself (the paper's sources plus self-lookup)."""
    from rhyme_lab.ablate.measures import timed_steps
    from rhyme_jax.config import load_config
    from rhyme_jax.data import load_problems
    from rhyme_jax.spec.history import HistoryStore
    from rhyme_jax.train.policy import build_tokenizer
    from rhyme_jax.train.prompts import PromptTokens

    run = Path(plain_unit["run_dir"])
    cfg = load_config(str(run / "config.yaml"))
    train, _ = load_problems(cfg.data)
    tokens = PromptTokens(build_tokenizer(cfg, run, train), train, cfg.model.prompt_template)
    cost, in_seconds = cost_model(cost_rows)
    timed = {s["step"]: s for s in timed_steps(plain_unit)}
    history = HistoryStore(cfg.spec.history_depth)  # written back after each step, as the trainer does
    num, den = {}, {}
    for s in plain_unit["steps"]:
        step = s["step"]
        ro, prompts, sources = _step_inputs(run, step, history, lambda p: np.array(tokens(p), np.int32), siblings)
        if step in timed:
            plain, oracle = step_bound(prompts, ro["responses"], sources, cost, cfg.rollout.max_new_tokens)
            measured = float(s.get("time/rollout_s", 0.0)) if in_seconds else plain
            ep = int(s.get("rollout/epoch", 1))
            num[ep] = num.get(ep, 0.0) + measured
            den[ep] = den.get(ep, 0.0) + with_oracle_passes(measured, plain, oracle)
        history.update(step, ro["prompt_ids"], prompts, ro["responses"], ro["rewards"])
    return {ep: num[ep] / den[ep] for ep in num if den[ep] > 0}
