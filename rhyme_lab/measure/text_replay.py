"""How much of a target text the HistoSpec drafter predicts: the library of ``python -m rhyme_lab replay-drafts``
(``rhyme_lab/cli/replay.py`` parses its flags and prints).

Each line of the input JSONL is ``{"prompt": str, "history": [str, ...], "history_rewards":
[float, ...], "target": str}``: a prompt, earlier responses to it (the history a rollout would
draft from) with their rewards, and the response to replay. Every prompt's history goes into a
``HistoryStore`` (one rollout per prompt) and the run's ``Drafter`` (``spec`` config section,
``--set spec.x=y``) drafts along each target as the engine would, ``--rows`` targets live at once:

* one pass of a live target = its draft (window, the tokens left, ``shapes.MAX_DRAFT``), sized
  as the engine sizes the drafts of a step (``allocation.choose_pass``): with the drafter's
  acceptance estimates (``spec.window=goodput``) the goodput choice under the pass-cost model
  (``--step-cost FILE``, else the config's ``spec.step_cost``, else the analytical prior), else
  longest first to the step's packed-token budget and the first step shape holding them;
  targets of the same prompt text share a prompt id (a GRPO group: ``spec.siblings``);
  with ``--accept-floor F`` instead, no step shape: each row sends the draft tokens whose
  estimated probability of acceptance (the product of the estimates up to that token) is at
  least F, as the suffix-tree peer's replay drafts (``measure.peer_replay``: no batching,
  a path-probability floor), which traces share against drafts per forward without the filler
  drafts a padded step shape takes for free;
* a draft token is accepted iff it equals the target's next token (the verification of a
  drafted pass emits the accepted prefix plus one token), and the drafter observes the pass.

Pooled over all targets it prints ``predicted_share`` (accepted / target tokens),
``tokens_per_forward`` (emitted per sequence pass), ``drafted_per_forward`` and ``acceptance``
(accepted / drafted) and ``modelled_speedup`` (plain decode's modelled seconds over the
replayed steps'). Pages are not simulated (the engine may also cut drafts to the pages the
pool can give). Source: RhymeRL (arXiv 2508.18588) s.4 HistoSpec; the issue "goodput-optimal
HistoSpec" scope 4.

    python -m rhyme_lab replay-drafts corpus.jsonl --tokenizer ~/.cache/rhyme_jax/models/smollm2-135m-instruct --json
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rhyme_jax.io.jsonl import JsonlError, read_jsonl
from rhyme_lab.measure.draft_replay import floor_pass, replay_targets

__all__ = ["ReplayCase", "ReplayInputError", "accept_floor_error", "floor_pass", "priced_cost", "read_cases",
           "replay"]


class ReplayInputError(ValueError):
    """A line of the replay file is malformed (message names the file and line)."""


@dataclass(frozen=True)
class ReplayCase:
    """One line: token ids of the prompt, its history responses and the target response."""

    prompt: np.ndarray  # int32[p]
    history: list[np.ndarray]  # int32[h_i]
    rewards: np.ndarray  # float64[len(history)]
    target: np.ndarray  # int32[t]


def read_cases(path: Path, encode) -> list[ReplayCase]:
    """Parse and tokenize the replay file.

    Raises:
      ReplayInputError: unreadable file, bad JSON, missing/ill-typed fields, rewards not matching
        the history, text the tokenizer rejects, or an empty target (named by file and line).
    """
    try:
        records = read_jsonl(path)
    except OSError as exc:
        raise ReplayInputError(f"{path}: {exc.strerror or exc}") from None
    try:
        cases = [_case(record.value, record.where, encode) for record in records]
    except JsonlError as exc:
        raise ReplayInputError(str(exc)) from None
    if not cases:
        raise ReplayInputError(f"{path}: no cases")
    return cases


def _case(row, where: str, encode) -> ReplayCase:
    """One tokenized case of the replay file (``where`` = ``"<path>:<line>"``; see ``read_cases``).

    Raises:
      ReplayInputError: as ``read_cases``, for this line.
    """
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) \
            or not isinstance(row.get("target"), str) or not isinstance(row.get("history"), list) \
            or not all(isinstance(h, str) for h in row["history"]):
        raise ReplayInputError(f"{where}: needs string 'prompt' and 'target' and a list of strings 'history'")
    rewards = row.get("history_rewards", [0.0] * len(row["history"]))
    if not isinstance(rewards, list) or len(rewards) != len(row["history"]) \
            or not all(isinstance(r, (int, float)) and np.isfinite(r) for r in rewards):
        raise ReplayInputError(f"{where}: 'history_rewards' must be {len(row['history'])} finite numbers")
    try:
        target = np.asarray(encode(row["target"]), np.int32)
        case = ReplayCase(np.asarray(encode(row["prompt"]), np.int32),
                          [np.asarray(encode(h), np.int32) for h in row["history"]],
                          np.asarray(rewards, np.float64), target)
    except ValueError as exc:  # the tokenizer's errors (e.g. characters outside its vocabulary)
        raise ReplayInputError(f"{where}: {exc}") from None
    if target.size == 0:
        raise ReplayInputError(f"{where}: 'target' encodes to no tokens")
    return case


def priced_cost(price: float):
    """The ``--draft-price`` cost: ``rows + price * (tokens - rows)`` row decodes per step."""
    def cost(rows: int, tokens: int, q_len: int) -> float:
        return rows + price * (tokens - rows)
    return cost


def _fill_store(cases: list[ReplayCase]) -> tuple[object, list[int], list[int]]:
    """A one-rollout ``HistoryStore`` of the distinct prompts' histories; returns it, each case's
    prompt id (cases with the same prompt text share one: a GRPO group) and the ids with history."""
    from rhyme_jax.spec.history import HistoryStore

    ids: dict[bytes, int] = {}
    pids = [ids.setdefault(c.prompt.tobytes(), len(ids)) for c in cases]
    first = {p: i for i, p in reversed(list(enumerate(pids)))}
    with_history = [p for p, i in sorted(first.items()) if cases[i].history]
    store = HistoryStore(1)
    if with_history:
        hist = [(p, cases[first[p]]) for p in with_history]
        store.update(0, np.array([p for p, c in hist for _ in c.history], np.int64),
                     [c.prompt for _, c in hist for _ in c.history], [h for _, c in hist for h in c.history],
                     np.concatenate([c.rewards for _, c in hist]))
    return store, pids, with_history


def replay(cases: list[ReplayCase], spec, plan, rows: int, cost=None, make_drafter=None,
           accept_floor: float | None = None) -> dict[str, float]:
    """Draft along every case's target, ``rows`` at a time (see the module docstring;
    ``draft_replay.replay_targets``), with the engine's step choice under ``cost``
    (``PassCost``; default the prior) or, with ``accept_floor``, ``floor_pass`` (no step shapes;
    steps still cost ``cost``). ``make_drafter(spec, store)``: the drafter (default
    ``rhyme_jax.spec.drafter.Drafter``; ``oracle_drafters.KnownTargets`` drafts the targets
    themselves, for upper bounds).

    Returns:
      ``predicted_share``, ``tokens_per_forward``, ``drafted_per_forward``, ``acceptance``,
      ``predicted_acceptance`` (the drafter's estimate of it; 0 without estimates),
      ``modelled_speedup`` (modelled plain-decode seconds / modelled seconds of the replayed
      steps), ``target_tokens``, ``sequence_passes``, ``drafted_tokens``, ``accepted_tokens``.
    """
    from rhyme_jax.rollout.pass_cost import PassCost
    from rhyme_jax.spec.drafter import Drafter

    cost = cost or PassCost.prior()
    store, pids, with_history = _fill_store(cases)
    with (make_drafter or Drafter)(spec, store) as drafter:
        drafter.rebuild(with_history)
        tally, steps, plain = replay_targets(drafter, [c.prompt for c in cases], [c.target for c in cases], pids,
                                             plan, rows, cost, accept_floor)
    tokens = sum(c.target.size for c in cases)
    drafted = tally.drafted
    return {"predicted_share": tally.accepted / tokens,
            "tokens_per_forward": tokens / tally.passes,
            "drafted_per_forward": drafted / tally.passes,
            "acceptance": tally.accepted / drafted if drafted else 0.0,
            "predicted_acceptance": steps.predicted / drafted if drafted else 0.0,
            "modelled_speedup": plain / steps.seconds if steps.seconds else 1.0,
            "target_tokens": tokens, "sequence_passes": tally.passes,
            "drafted_tokens": drafted, "accepted_tokens": tally.accepted}


def accept_floor_error(floor: float | None, window: str) -> str:
    """Why ``--accept-floor`` cannot run ('' when it can): a probability, with the goodput
    drafter's estimates."""
    if floor is None:
        return ""
    if not 0 <= floor <= 1:
        return f"--accept-floor: expected a probability in [0, 1], got {floor}"
    if window != "goodput":
        return f"--accept-floor needs spec.window=goodput (the drafter's estimates), got spec.window={window}"
    return ""
