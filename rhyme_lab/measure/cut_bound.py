"""What stops the engine's cut short of the oracle bound: its estimates, or its drafts?

The paired oracle units put the goodput drafter at 85-91% (demo) and 74-85% (SmolLM2) of the
source-bound oracle's rollout speed-up on the CPU (docs/results.md, L1 and L2). The oracle differs
from the drafter twice over: it knows which draft tokens will be accepted (it never sends a
rejected one, so its verify programs are no larger than they pay for) and it drafts from
hindsight (the longest run of the emitted tokens that any occurrence in its sources holds). This
module separates the two without a model: over one saved step it drives, each pass sized by the
engine's allocation under one pass-cost model (``draft_replay.EnginePasses``),

* ``estimates``: the run's drafter with its own acceptance estimates (what the engine does);
* ``known``: the same drafter, its estimates replaced by the truth (1 for each draft token the
  emitted response holds, up to the first that it does not, 0 after; ``KnownAcceptance``): the
  best any estimate of these drafts could do, since the cut then sends exactly the tokens that
  will be accepted where they pay for their program;
* ``oracle``: ``oracle_drafters.SourceBoundDrafter`` over the same sources (history, finished and
  running siblings, the row itself);

and, given the policy's modes at every response position (``measure.policy_mode``),

* ``policy``: ``policy_mode.ModeDrafter``, the policy's greedy continuation with its exact
  acceptance probabilities as estimates: the causal reference, what a drafter that knows the
  policy (and drafts for free) reaches;
* ``policy_known``: the same drafts with known acceptance;

and, with ``cross``, ``oracle_cross``: ``oracle_drafters.CrossPromptBoundDrafter``, the oracle whose
sources also hold every prompt's earlier responses and the step's other rows (whether drafts
from other prompts' text could add anything, even with hindsight);

and plain decode (``draft_replay.plain_seconds``). Modelled seconds, so ratios are of the model,
not of a clock: ``known / oracle`` is the share of the bound that sharper estimates could reach
with these drafts; the rest needs other drafts.

Source: issue 32 (the >= 90%-of-the-bound target); RhymeRL (arXiv 2508.18588) s.4 HistoSpec.
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Int

from rhyme_lab.measure.draft_replay import EnginePasses, Tally, accepted_prefix, drive, plain_seconds
from rhyme_lab.measure.oracle_drafters import CrossPromptBoundDrafter, SourceBoundDrafter
from rhyme_lab.measure.pass_replay import WithSiblings, sibling_rebatch
from rhyme_lab.measure.policy_mode import ModeDrafter
from rhyme_jax.spec.drafter import Drafter
from rhyme_jax.spec.history import HistoryStore

MODES = ("estimates", "known", "oracle")
POLICY_MODES = ("policy", "policy_known")
CROSS_MODE = "oracle_cross"


class KnownAcceptance:
    """A ``rollout.types.Drafter`` batch whose acceptance estimates are the truth.

    Wraps the batches of one step replay (``wrap``; a rebatch's new batch is wrapped too): drafts
    and observations are the inner batch's; after each ``draft`` the ``estimates`` (``float32[n,
    K]``) are 1 for the first ``a_i`` tokens of row i's draft, ``a_i`` its leading tokens that
    ``targets[reqs[i]]`` holds next, and 0 after. The rows' progress is tracked as ``drive``
    tracks it (``emitted`` tokens before the first pass, then ``accepted + 1`` per pass).

    Args:
      targets: ``int[t_i]`` each row's emitted response; emitted: tokens emitted before the
        first pass (1: the prefill's).
    """

    def __init__(self, targets: list[np.ndarray], emitted: int = 1):
        self.targets = [np.asarray(t, np.int64) for t in targets]
        self.sizes = np.array([t.size for t in self.targets], np.int64)
        self.done = np.minimum(emitted, self.sizes)
        self.batch = None
        self.estimates: np.ndarray | None = None

    def wrap(self, batch):
        """This object drafting with ``batch`` (``None``: ``None``, as ``drive``'s rebatch reads it)."""
        if batch is None:
            return None
        self.batch = batch
        return self

    @property
    def context_width(self) -> int:
        """The inner batch's context width."""
        return self.batch.context_width

    @property
    def priorities(self):
        """The inner batch's priorities (``None`` when it has none)."""
        return getattr(self.batch, "priorities", None)

    def draft(self, reqs: Int[np.ndarray, "n"], tails, budgets):
        """The inner batch's ``(drafts int32[n, K], lens int[n])``; sets the true ``estimates``."""
        drafts, lens = self.batch.draft(reqs, tails, budgets)
        reqs = np.asarray(reqs, np.int64)
        held = accepted_prefix(drafts, np.asarray(lens, np.int64), self.targets, reqs, self.done)
        self.estimates = (np.arange(drafts.shape[1])[None, :] < held[:, None]).astype(np.float32)
        return drafts, lens

    def observe(self, reqs, draft_lens, accepted) -> None:
        """Forwarded to the inner batch; advances the rows as ``drive`` does."""
        self.batch.observe(reqs, draft_lens, accepted)
        reqs = np.asarray(reqs, np.int64)
        self.done[reqs] = np.minimum(self.done[reqs] + np.asarray(accepted, np.int64) + 1, self.sizes[reqs])


def _figures(steps: EnginePasses, tally: Tally) -> dict:
    return {"seconds": float(steps.seconds), "passes": int(tally.passes), "drafted": int(tally.drafted),
            "accepted": int(tally.accepted)}


def bound_step(max_new: int, prompts: dict, pids: Int[np.ndarray, "N"], responses, rewards,
               history: HistoryStore, plan, cost, drafters: dict[str, Drafter], modes: list | None = None,
               cross: bool = False) -> dict:
    """One saved step under the three modes (module docstring) and plain decode.

    Args:
      max_new: ``rollout.max_new_tokens``.
      prompts: prompt id -> ``int32[p]``; ``pids``: ``int[N]`` prompt id per row.
      responses, rewards: the step's emitted ``int32[L_i]`` responses and their rewards.
      history: the history store as the trainer held it when the step ran.
      plan, cost: the engine's ``shapes.plan`` and a pass-cost model ``cost(rows, tokens, q_len)``
        (e.g. a unit's profile, ``ablate.oracle.cost_model``).
      drafters: ``{"estimates": Drafter, "known": Drafter}``, one per mode for the whole run (each
        learns its calibration over the steps as the engine's does; ``known`` ignores its
        estimates but its drafts depend on what it observed).
      modes: per row ``(argmax int32[t_i], p_mode float32[t_i])`` (``policy_mode.load_modes``):
        also the ``POLICY_MODES``. cross: also ``CROSS_MODE``.

    Returns ``{"tokens": generated tokens, "plain_seconds": float, mode: {"seconds", "passes",
    "drafted", "accepted"}}``: modelled seconds of the chosen steps, sequence passes after the
    prefill, draft tokens sent and accepted.
    """
    rows = [np.asarray(prompts[int(p)], np.int64) for p in pids]
    targets = [np.asarray(r, np.int64) for r in responses]
    out: dict = {"tokens": int(sum(t.size for t in targets)),
                 "plain_seconds": float(plain_seconds([max(t.size - 1, 0) for t in targets], plan, cost))}
    for mode in MODES + (POLICY_MODES if modes is not None else ()) + ((CROSS_MODE,) if cross else ()):
        steps, tally = EnginePasses(plan, cost), Tally()
        if mode in POLICY_MODES:
            batch = ModeDrafter(rows, targets, modes, max_new)
            wrap = KnownAcceptance(targets).wrap if mode == "policy_known" else (lambda b: b)
            drive(wrap(batch), rows, targets, emitted=1, max_new=max_new, send=steps, tally=tally)
        elif mode in ("oracle", CROSS_MODE):
            hist = [list(history.responses(int(p))[0]) if int(p) in history else [] for p in pids]
            if mode == "oracle":
                batch = SourceBoundDrafter(rows, targets, max_new, hist)
            else:
                others = [r for q in history.prompt_ids() for r in history.responses(q)[0]]
                batch = CrossPromptBoundDrafter(rows, targets, max_new, hist, others)
            drive(batch, rows, targets, emitted=1, max_new=max_new, send=steps, tally=tally)
        else:
            store = WithSiblings(history, prompts, responses, rewards)
            drafter = drafters[mode]
            drafter.store = store
            rebatch = sibling_rebatch(drafter, store, pids, targets)
            wrap = KnownAcceptance(targets).wrap if mode == "known" else (lambda b: b)
            drive(wrap(drafter.batch(pids)), rows, targets, emitted=1, max_new=max_new, send=steps, tally=tally,
                  rebatch=lambda *a: wrap(rebatch(*a)))
        out[mode] = _figures(steps, tally)
    return out


def _modes(result: dict) -> tuple[str, ...]:
    return tuple(m for m in MODES + POLICY_MODES + (CROSS_MODE,) if m in result)


def merge(steps: list[dict]) -> dict:
    """Sum of ``bound_step`` results (the modes of the first step; all steps must have them)."""
    modes = _modes(steps[0]) if steps else MODES
    total: dict = {"tokens": 0, "plain_seconds": 0.0, **{m: {"seconds": 0.0, "passes": 0, "drafted": 0,
                                                             "accepted": 0} for m in modes}}
    for s in steps:
        total["tokens"] += s["tokens"]
        total["plain_seconds"] += s["plain_seconds"]
        for m in modes:
            for k in total[m]:
                total[m][k] += s[m][k]
    return total


def ratios(merged: dict) -> dict:
    """``{mode: plain seconds / mode seconds}`` and ``{mode + "_share": ratio / oracle ratio}``
    of a ``merge``d epoch (0 where a figure is 0)."""
    modes = _modes(merged)
    out = {m: merged["plain_seconds"] / merged[m]["seconds"] if merged[m]["seconds"] > 0 else 0.0 for m in modes}
    out.update({f"{m}_share": out[m] / out["oracle"] if out["oracle"] > 0 else 0.0 for m in modes})
    return out
