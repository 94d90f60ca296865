"""The passes the device's history lookup would need at a fixed draft room, replayed on saved tokens.

The chunked HistoSpec engine drafts on the device with ``rollout.device_drafts.lookup_drafts``
(the row's longest suffix match in its history and its own last ``CONTEXT`` tokens); how many
tokens it sends is the ``SpecGuard``'s choice of verify program. This replay takes the guard
away: before every pass each live row drafts ``room`` tokens (at most ``device_drafts.MATCH``)
with the same function over the same sources, a draft token is accepted exactly when it is the
saved token there (lossless verification with one-hot drafts: ``measure.draft_replay``), and the
pass emits the accepted prefix plus one token. Rows run in lock step, so a step's passes are
its longest row's. The result bounds what the lookup itself can do on these tokens (the engine
pays a verify pass's seconds for every drafted token; this counts passes only) and shows where
along a response its drafts land (accepted tokens a pass, by position band). No model runs.

Source: RhymeRL (arXiv 2508.18588) s.4 HistoSpec; prompt-lookup decoding over the row's own
tokens; the ledger task's rows at the 4,096-token cap (docs/results.md, "L6").
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jaxtyping import Int

from rhyme_jax.rollout.chunk_spec import CONTEXT
from rhyme_jax.rollout.device_drafts import MATCH, lookup_drafts
from rhyme_lab.measure.draft_replay import accepted_prefix, tails

_lookup = jax.jit(lookup_drafts, static_argnums=(3, 4))


@dataclass
class LookupReplay:
    """One lock-step replay of ``n`` rows.

    Attributes:
      passes: ``int64[n]`` passes each row took (its saved length where nothing is accepted).
      log: ``int64[m, 4]`` one line per row-pass: row, tokens emitted before it, drafted, accepted.
    """

    passes: np.ndarray
    log: np.ndarray

    def accepted_by_band(self, row: int, band: int) -> dict[int, float]:
        """Accepted draft tokens per pass of ``row`` by the band of ``band`` tokens its pass began in
        (band start -> mean)."""
        mine = self.log[self.log[:, 0] == row]
        out = {}
        for b in np.unique(mine[:, 1] // band):
            sel = mine[:, 1] // band == b
            out[int(b * band)] = float(mine[sel, 3].mean())
        return out


def replay(prompts: list[np.ndarray], responses: list[np.ndarray], histories: list[list[np.ndarray]] | None = None,
           room: int = MATCH, context: int = CONTEXT, history_width: int = 0, pattern_min: int = 1) -> LookupReplay:
    """Replay ``lookup_drafts`` along ``responses`` (module docstring).

    Args:
      prompts, responses: per row, 1-D int token arrays (the saved rollout).
      histories: per row, earlier responses of its prompt (``-1``-separated, the last
        ``history_width`` tokens, right-aligned, as ``chunk_spec.history`` lays them); None: none.
      room: draft tokens a row asks for before each pass (``lookup_drafts`` caps it at ``MATCH``).
      context: own tokens searched (prompt + response so far, the last ``context``).
      history_width: ``H`` columns of history (0 with no histories).
      pattern_min: shortest suffix matched.

    Raises:
      ValueError: ``room`` below 1, or histories without a ``history_width``.
    """
    if room < 1:
        raise ValueError(f"room must be at least 1, got {room}")
    if histories is not None and history_width < 1:
        raise ValueError("histories need history_width >= 1")
    n = len(responses)
    lens = np.array([r.size for r in responses], np.int64)
    hist = np.full((n, history_width), -1, np.int32)
    for i, pieces in enumerate(histories or []):
        joined = np.concatenate([np.r_[np.asarray(p, np.int32), -1] for p in pieces]) if pieces else np.zeros(0, np.int32)
        joined = joined[-history_width:]
        hist[i, history_width - joined.size:] = joined
    done, passes, log = np.zeros(n, np.int64), np.zeros(n, np.int64), []
    rows = np.arange(n)
    while (live := done < lens).any():
        source = np.concatenate([hist, tails(prompts, responses, rows, done, context)], axis=1)
        max_lens = np.where(live, np.minimum(room, lens - done - 1), 0).astype(np.int32)
        drafts, dl = _lookup(source, np.int32(pattern_min), max_lens, room, history_width)
        drafts, dl = np.asarray(drafts), np.asarray(dl, np.int64)
        acc = accepted_prefix(drafts, dl, responses, rows, done)
        ids = np.flatnonzero(live)
        log.append(np.stack([ids, done[ids], dl[ids], acc[ids]], axis=1))
        done[ids] += acc[ids] + 1
        passes[ids] += 1
    return LookupReplay(passes, np.concatenate(log) if log else np.zeros((0, 4), np.int64))


def step_rows(run_dir, step: int, top: int) -> tuple[list[int], list[np.ndarray], list[np.ndarray], np.ndarray]:
    """``(rows, prompts, responses, prompt_ids)`` of the ``top`` longest responses of a saved step
    (``io.rollout_log``). The log holds no prompt tokens, so the prompts are empty: the replay
    then searches the response alone (the engine's context also holds the prompt's tail)."""
    from rhyme_jax.io.rollout_log import load_rollouts

    d = load_rollouts(run_dir, step)
    responses = [np.asarray(r, np.int32) for r in d["responses"]]
    order = [int(i) for i in np.argsort([-r.size for r in responses], kind="stable")[:top]]
    prompts = [np.zeros(0, np.int32) for _ in order]
    return order, prompts, [responses[i] for i in order], np.asarray(d["prompt_ids"])[order]


def earlier_responses(run_dir, step: int, prompt_ids: Int[np.ndarray, "n"]) -> list[list[np.ndarray]]:
    """Per prompt id, the responses of the latest saved step before ``step`` that held it (the
    history a recurring prompt drafts from); empty lists where none did."""
    from rhyme_jax.io.rollout_log import list_rollout_steps, load_rollouts

    out: list[list[np.ndarray] | None] = [None] * len(prompt_ids)
    for s in reversed([s for s in list_rollout_steps(run_dir) if s < step]):
        if all(o is not None for o in out):
            break
        d = load_rollouts(run_dir, s)
        ids = np.asarray(d["prompt_ids"])
        for i, p in enumerate(prompt_ids):
            if out[i] is None and (ids == p).any():
                out[i] = [np.asarray(d["responses"][j], np.int32) for j in np.flatnonzero(ids == p)]
    return [o or [] for o in out]


def step_report(run_dir, step: int, *, room: int = MATCH, context: int = CONTEXT, history_width: int = 0,
                top: int = 4, band: int = 512) -> dict:
    """The replay of the ``top`` longest rows of saved step ``step``: ``plain_passes`` (its longest
    response), ``passes`` (the replay's, its longest row's) and per row its length, passes and
    accepted draft tokens a pass by position band (``LookupReplay.accepted_by_band``); with
    ``history_width`` the rows also draft from their prompt's latest earlier responses."""
    rows, prompts, responses, pids = step_rows(run_dir, step, top)
    hist = earlier_responses(run_dir, step, pids) if history_width else None
    r = replay(prompts, responses, hist, room=room, context=context, history_width=history_width)
    return {"step": step, "plain_passes": int(max(x.size for x in responses)), "passes": int(r.passes.max()),
            "rows": [{"row": row, "length": int(resp.size), "passes": int(p), "accepted_by_band": r.accepted_by_band(i, band)}
                     for i, (row, resp, p) in enumerate(zip(rows, responses, r.passes))]}


__all__ = ["LookupReplay", "earlier_responses", "replay", "step_report", "step_rows"]
