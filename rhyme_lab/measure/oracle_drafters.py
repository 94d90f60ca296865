"""Oracle drafters: drafters that know the tokens a sequence will emit, for upper bounds.

* ``AlwaysRightDrafter`` drafts each row's known next tokens, estimates 1: every draft token is
  accepted and the engine's allocation sizes each step under its pass-cost model alone, so no
  drafter through that engine beats it (``benchmarks.rollout --oracle`` live, with the plain
  rollout's tokens; ``benchmarks.replay_bound`` along target texts).
* ``SourceBoundDrafter`` cuts those drafts to the longest run a draft source holds
  (``held_run``: the prompt's earlier responses, its siblings so far, the row's own context):
  the bound of any drafter over those sources (``--oracle sources`` / ``--sources``);
  ``CrossPromptBoundDrafter`` adds other prompts' responses to them.
* ``held_run`` with a context suffix of ``k`` tokens is also the search of the per-sequence
  pass oracle (``measure.pass_replay.best_continuation``).

Both drafters follow ``rollout.types.Drafter``: requests are indices into the call's prompts,
``context_width`` covers a whole sequence, so a row's tail tells how many tokens it has emitted.
"""

from __future__ import annotations

from collections import deque

import numpy as np
from jaxtyping import Int

from rhyme_jax.rollout.device_drafts import MATCH
from rhyme_jax.rollout.shapes import MAX_DRAFT

ORACLES = ("always-right", "sources")


class AlwaysRightDrafter:
    """A ``rollout.types.Drafter`` that drafts the tokens a rollout will emit, known beforehand.

    ``prompts``: the call's prompts (token sequences); ``responses``: ``int32[t_i]`` each row's
    known response (live: the plain rollout of the same prompts, weights and key; with the
    per-position draws the drafted rollout emits those, unless a near tie rounds the other way in
    another step program; in a replay: the targets). ``max_new_tokens``: the longest response.
    Every draft token is accepted and its estimate is 1, so the engine's goodput allocation sizes
    each step under its pass-cost model alone: the rollout's speed bounds any drafter's through
    this engine on this machine (live, prefill included). ``rank``: also give ``priorities``
    (``float32[n]`` tokens each row has left), so the allocation weighs long rows as it does the
    real drafter's predictions (``benchmarks.replay_bound``)."""

    pattern_min = MATCH // 2  # chunked engine: the device drafts only from a match this long (the row's own place)

    def __init__(self, prompts, responses, max_new_tokens: int, rank: bool = False):
        self.prompt_lens = np.array([len(p) for p in prompts], np.int64)
        self.sequences = [np.concatenate([np.asarray(p, np.int32), np.asarray(r, np.int32)])
                          for p, r in zip(prompts, responses)]
        self._made: dict[int, int] = {}
        self.responses = [np.asarray(r, np.int32) for r in responses]
        self.context_width = int(self.prompt_lens.max(initial=1)) + int(max_new_tokens)
        self.rank = rank
        self.estimates: np.ndarray | None = None
        self.priorities: np.ndarray | None = None

    def made(self, reqs: Int[np.ndarray, "n"], tails: Int[np.ndarray, "n W"]) -> Int[np.ndarray, "n"]:
        """``int64[n]`` tokens each row of ``reqs`` has generated (from its whole-sequence tail)."""
        return np.maximum((np.asarray(tails) >= 0).sum(axis=1) - self.prompt_lens[reqs], 0)

    def draft(self, reqs, tails, budgets):
        """The next ``min(budget, MAX_DRAFT)`` tokens of each row's known response:
        ``(int32[n, MAX_DRAFT], int32[n])``."""
        reqs = np.asarray(reqs, np.int64)
        made = self.made(reqs, tails)
        self._made.update(zip(reqs.tolist(), made.tolist()))
        lens = np.zeros(reqs.size, np.int32)
        out = np.zeros((reqs.size, MAX_DRAFT), np.int32)
        for i, (r, n, b) in enumerate(zip(reqs, made, np.asarray(budgets))):
            d = self.responses[r][int(n): int(n) + min(int(b), MAX_DRAFT)]
            out[i, : d.size], lens[i] = d, d.size
        self.estimates = (np.arange(MAX_DRAFT)[None, :] < lens[:, None]).astype(np.float32)
        if self.rank:
            self.priorities = np.array([self.responses[r].size - n for r, n in zip(reqs, made)], np.float32)
        return out, lens

    def observe(self, reqs, draft_lens, accepted) -> None:
        """Nothing to learn."""

    def history_rows(self, reqs: Int[np.ndarray, "B"], width: int) -> Int[np.ndarray, "B H"]:
        """The chunked engine's device history (``rollout/chunk_spec.py``): ``int32[B, width]``,
        each row's known sequence (prompt + response) from ``MATCH`` tokens before where the row
        stood at its last ``draft`` on, so the device's suffix match finds the row's own place
        and drafts what it will emit for the whole chunk (``-1`` after the end)."""
        out = np.full((len(reqs), width), -1, np.int32)
        for i, r in enumerate(np.asarray(reqs, np.int64).tolist()):
            at = int(self.prompt_lens[r]) + self._made.get(r, 0)
            piece = self.sequences[r][max(at - MATCH, 0): max(at - MATCH, 0) + width]
            out[i, : piece.size] = piece
        return out

    def observe_chunk(self, reqs, drafted, accepted, counts) -> None:
        """Nothing to learn."""


def held_run(sources: list[np.ndarray], ctx: np.ndarray, rest: np.ndarray, k: int = 1) -> int:
    """How many leading tokens of ``rest`` follow some occurrence of ``ctx``'s last ``k`` tokens
    in a source or earlier in ``ctx`` (self-lookup); 0 when ``ctx`` is shorter than ``k``.

    With ``k = 1`` every suffix match of any length ends at such an occurrence, so this is the
    longest draft any suffix drafter with a minimum match of 1 token could find there: the best
    source in hindsight. (``ctx``'s own end is searched too; a pad follows it, so it adds nothing;
    a source's end stops a run.) Arrays are token ids (>= 0), any integer dtype.
    """
    if ctx.size < max(k, 1) or rest.size == 0:
        return 0
    n = rest.size
    pad = np.full(n, -2, np.int64)
    parts = [x for src in sources for x in (np.asarray(src, np.int64), pad)] + [np.asarray(ctx, np.int64), pad]
    hay = np.concatenate(parts)
    at = np.flatnonzero(hay[:-n] == ctx[-1])
    for i in range(1, k):  # the earlier tokens of the pattern
        at = at[at >= i]
        at = at[hay[at - i] == ctx[-1 - i]]
    if at.size == 0:
        return 0
    same = hay[at[:, None] + 1 + np.arange(n)] == np.asarray(rest, np.int64)[None, :]
    return int(np.cumprod(same, axis=1).sum(axis=1).max())


class SourceBoundDrafter(AlwaysRightDrafter):
    """``AlwaysRightDrafter`` cut to what the draft sources hold: each row drafts the longest run
    of its next known tokens that follows an occurrence of its last token (``held_run``) in the
    prompt's earlier responses (``history[r]``: ``int32`` responses, the prompt is prepended), in
    the responses of the same prompt in this call so far (siblings, up to what they have
    emitted, prompt prepended) or in the row's own context. Estimates 1, so the engine's
    allocation sizes each step: the rollout's speed bounds any drafter over these sources."""

    def __init__(self, prompts, responses, max_new_tokens: int, history: list[list[np.ndarray]],
                 rank: bool = False):
        super().__init__(prompts, responses, max_new_tokens, rank)
        self.prompts = [np.asarray(p, np.int64) for p in prompts]
        self.history = [[np.concatenate([self.prompts[r], h]) for h in hs] for r, hs in enumerate(history)]
        keys = [p.tobytes() for p in self.prompts]
        self.siblings = [[j for j in range(len(keys)) if j != r and keys[j] == keys[r]] for r in range(len(keys))]
        self.done = np.zeros(len(keys), np.int64)

    def draft(self, reqs, tails, budgets):
        """``AlwaysRightDrafter.draft`` with each length cut by ``held_run`` over the sources."""
        reqs = np.asarray(reqs, np.int64)
        out, lens = super().draft(reqs, tails, budgets)
        made = self.made(reqs, tails)
        self.done[reqs] = made
        for i, (r, n) in enumerate(zip(reqs, made)):
            resp = self.responses[r]
            sibs = [np.concatenate([self.prompts[j], self.responses[j][: self.done[j]]]) for j in self.siblings[r]]
            ctx = np.concatenate([self.prompts[r], resp[:n]])
            lens[i] = held_run(self.history[r] + sibs, ctx, out[i, : lens[i]])
        self.estimates = (np.arange(MAX_DRAFT)[None, :] < lens[:, None]).astype(np.float32)
        return out, lens

    def history_rows(self, reqs, width):
        """Not a bound in the chunked engine: its device drafts would not be cut to the sources.

        Raises:
          NotImplementedError: always (run it with ``rollout.passes_per_dispatch: 1``)."""
        raise NotImplementedError("SourceBoundDrafter bounds the per-pass engine only: set "
                                  "rollout.passes_per_dispatch=1 (the chunk's device drafts are not cut to the sources)")

    def observe(self, reqs, draft_lens, accepted) -> None:
        """Siblings see each row's tokens as soon as they are emitted."""
        self.done[np.asarray(reqs, np.int64)] += np.asarray(accepted, np.int64) + 1


class CrossPromptBoundDrafter(SourceBoundDrafter):
    """``SourceBoundDrafter`` whose sources also hold other prompts' text: ``others`` (``int``
    arrays, e.g. every prompt's earlier responses) and every other row of the call so far, not
    only its siblings. With hindsight like its parent, so it bounds any drafter that would also
    look up other prompts' responses (a global suffix tree, as ArcticInference's)."""

    def __init__(self, prompts, responses, max_new_tokens: int, history: list[list[np.ndarray]],
                 others: list[np.ndarray]):
        super().__init__(prompts, responses, max_new_tokens, history)
        parts = [x for o in others for x in (np.asarray(o, np.int64), np.full(1, -2, np.int64))]
        joined = np.concatenate(parts) if parts else np.zeros(0, np.int64)  # one -2 stops a run
        self.history = [h + [joined] for h in self.history]
        self.siblings = [[j for j in range(len(self.prompts)) if j != r] for r in range(len(self.prompts))]


class SourceBound:
    """Makes a ``SourceBoundDrafter`` per rollout and remembers each prompt's responses as the
    history of its next rollouts (``benchmarks.rollout --oracle sources``). ``depth``: how many of
    the prompt's latest rollouts (calls it appeared in) stay sources, as ``spec.history_depth``
    keeps them for the real drafter; ``None``: all of them."""

    def __init__(self, depth: int | None = None):
        self.depth = depth
        self.seen: dict[bytes, deque[list[np.ndarray]]] = {}  # prompt -> its responses per call

    def __call__(self, prompts, responses, max_new_tokens: int) -> SourceBoundDrafter:
        keys = [np.asarray(p, np.int64).tobytes() for p in prompts]
        history = [[h for call in self.seen.get(k, ()) for h in call] for k in keys]
        drafter = SourceBoundDrafter(prompts, responses, max_new_tokens, history)
        calls: dict[bytes, list[np.ndarray]] = {}
        for k, resp in zip(keys, responses):
            calls.setdefault(k, []).append(np.asarray(resp, np.int64))
        for k, resp in calls.items():
            self.seen.setdefault(k, deque(maxlen=self.depth)).append(resp)
        return drafter


class KnownTargets:
    """``measure.text_replay.replay``'s ``make_drafter`` for bounds along known targets: each
    ``batch(prompt_ids)`` drafts the next consecutive group of ``targets`` (``int32[t_i]``, after
    ``prompts``), in replay order, with ``AlwaysRightDrafter`` (``rank``: the remaining tokens as
    priorities) or, given ``history`` (``int32`` earlier responses per target), with
    ``SourceBoundDrafter`` (the bound over history, sibling and self sources)."""

    def __init__(self, prompts: list[np.ndarray], targets: list[np.ndarray],
                 history: list[list[np.ndarray]] | None = None):
        self.prompts, self.targets, self.history, self.next = prompts, targets, history, 0
        self.longest = max((t.size for t in targets), default=1)

    def __call__(self, spec, store):
        """``make_drafter(spec, store)``: this object (it needs neither)."""
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def rebuild(self, prompt_ids) -> None:
        """Nothing to index."""

    def batch(self, prompt_ids) -> AlwaysRightDrafter:
        """The drafter of the next ``len(prompt_ids)`` targets."""
        lo, self.next = self.next, self.next + len(prompt_ids)
        got = slice(lo, self.next)
        if self.history is None:
            return AlwaysRightDrafter(self.prompts[got], self.targets[got], self.longest, rank=True)
        return SourceBoundDrafter(self.prompts[got], self.targets[got], self.longest, self.history[got], rank=True)
