"""Public types of the rollout engine: sampling settings, results, progress, drafter, errors.

Kept apart from ``engine.py`` so schedulers and gatherers can use them without the engine's
machinery; ``rhyme_jax.rollout.engine`` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
from jaxtyping import Int

from rhyme_jax.rollout.sampling import sampling_mode

if TYPE_CHECKING:
    from rhyme_jax.config import RolloutSection


@dataclass(frozen=True)
class SamplingParams:
    """Per-call sampling settings (temperature 0 = greedy; top_k 0 / top_p 1.0 = off)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64

    @classmethod
    def from_section(cls, rollout: "RolloutSection", max_new_tokens: int | None = None) -> "SamplingParams":
        """The sampling of a run's ``rollout`` config section (``max_new_tokens``: its own, or
        this override)."""
        return cls(temperature=rollout.temperature, top_k=rollout.top_k, top_p=rollout.top_p,
                   max_new_tokens=rollout.max_new_tokens if max_new_tokens is None else int(max_new_tokens))

    @property
    def mode(self) -> str:
        """The sampling program these settings compile to (``rhyme_jax.rollout.sampling.MODES``:
        ``"greedy"`` at temperature 0, ``"filtered"`` with top-k or top-p on, else ``"plain"``;
        ``"dynamic"`` if a setting is a traced array), via ``sampling.sampling_mode``.

        Raises:
          SamplingError: temperature < 0, top_k < 0 or top_p outside (0, 1].
        """
        return sampling_mode(self.temperature, self.top_k, self.top_p)


class PromptTooLongError(ValueError):
    """A prompt exceeds ``max_prompt_len`` (message names its index and length)."""


class EngineConfigError(ValueError):
    """Engine construction or call arguments are inconsistent (message names the field)."""


@dataclass
class RolloutResult:
    """Responses of one ``generate`` call, in prompt order.

    Attributes:
      tokens: per prompt ``int32[n]`` response ids, EOS included when emitted.
      logprobs: per prompt ``float32[n]`` behaviour logprobs of those tokens.
      finish_reasons: ``"eos" | "length" | "skipped" | "migrated"`` (stopped by the monitor).
      stats: prefill_tokens, generated_tokens, decode_steps (decode forward passes),
        prefill_steps, forward_passes (both), preemptions, skipped, seconds, tokens_per_s,
        drafted_tokens, accepted_tokens, acceptance_rate, predicted_accepted and
        predicted_acceptance (from the drafter's estimates), drafting_seconds (host time inside
        the drafter), sequence_steps (forward passes summed over the sequences in them),
        tokens_per_forward (generated tokens per sequence forward pass; 1.0 without drafts),
        decode_dispatches (device calls running decode/verify passes: ``decode_steps`` per pass,
        fewer with ``passes_per_dispatch > 1``) and device_wait_seconds (host seconds blocked
        fetching pass outputs after their dispatch: device time plus the transfer; prefill_wait_seconds
        is its part spent on prefill passes);
        spec_chunk_seconds / spec_chunk_passes / spec_chunk_row_passes: wall seconds, passes and
        live row-passes of the HistoSpec chunks (``rollout/chunk_spec.py``; 0 without them);
        spec_chunks_declined: chunks the host's choice sent drafts for that ran plain because no
        verify program at their row bucket and width had emitted more tokens a second than
        decode (``rollout/spec_guard.py``).
    """

    tokens: list[np.ndarray]
    logprobs: list[np.ndarray]
    finish_reasons: list[str]
    stats: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Progress:
    """What ``generate``'s ``monitor`` sees after a decode step (host arrays, copies).

    Attributes:
      running: ``int64[r]`` request indices in slots now.
      waiting: ``int64[w]`` request indices queued (not admitted, or preempted).
      generated: ``int64[n]`` response tokens so far per request (prefix included).
      decode_steps: decode/verify passes run so far in this call.
    """

    running: np.ndarray
    waiting: np.ndarray
    generated: np.ndarray
    decode_steps: int


def derive_rates(stats: dict) -> dict:
    """Fill the rates of a ``RolloutResult.stats`` from its counts (in place; also returned):
    ``acceptance_rate`` = accepted / drafted tokens, ``predicted_acceptance`` = the drafter's
    estimate of it (expected accepted / drafted tokens; 0 without estimates), ``tokens_per_forward`` = generated tokens per
    sequence forward pass, ``tokens_per_s`` = generated tokens / ``seconds``."""
    stats["acceptance_rate"] = stats["accepted_tokens"] / max(stats["drafted_tokens"], 1)
    stats["predicted_acceptance"] = stats.get("predicted_accepted", 0.0) / max(stats["drafted_tokens"], 1)
    stats["tokens_per_forward"] = stats["generated_tokens"] / max(stats["sequence_steps"], 1)
    stats["tokens_per_s"] = stats["generated_tokens"] / stats["seconds"] if stats["seconds"] > 0 else 0.0
    return stats


class Drafter(Protocol):
    """What ``RolloutEngine.generate`` needs of a speculative drafter (HistoSpec's
    ``rhyme_jax.spec.drafter.DraftBatch``, or a test drafter). Requests are indices into the
    call's prompts. The engine alone fits drafts to its step: it caps each length at the
    request's remaining budget, ``shapes.MAX_DRAFT``, the step's token budget and the pages it
    can give, so a drafter may return any width ``K``.

    Attributes:
      context_width: tokens of each running sequence (prompt + response) the engine passes as
        ``tails`` (>= 0).
      estimates: after each ``draft`` call, ``float32[n, K]`` (the same rows and columns as its
        tokens) estimated probability that draft token j of row i is accepted given that tokens
        ``< j`` were, or ``None`` when the drafter gives no estimates. With estimates the engine
        chooses each row's draft length and the step shape for the most expected tokens per
        second under its pass-cost model (``rollout/allocation.py``); without, it keeps every
        draft that fits the first step shape holding it.
      priorities: optionally, after each ``draft`` call, ``float32[n]`` tokens each row is
        predicted still to generate (the allocation weighs rows predicted long up to twice), or
        ``None``.
      idle: optionally, ``True`` when no request of the call can ever get a draft (HistoSpec:
        no prompt has history and no lookup source is on, e.g. a run's first epoch); the engine
        then decodes plainly without calling the drafter, exactly as without one.
    """

    context_width: int
    estimates: "np.ndarray | None"

    def draft(self, reqs: Int[np.ndarray, "n"], tails: Int[np.ndarray, "n W"],
              budgets: Int[np.ndarray, "n"]) -> tuple[Int[np.ndarray, "n K"], Int[np.ndarray, "n"]]:
        """Drafts of ``n`` running requests ``reqs`` (distinct), from their last
        ``W = context_width`` tokens ``tails`` (left-padded with -1); row i may use up to
        ``budgets[i]`` tokens. Returns ``(tokens int32[n, K], lens int[n])``, ``lens <= K``
        (tokens past ``lens[i]`` are ignored)."""
        ...

    def observe(self, reqs: Int[np.ndarray, "n"], draft_lens: Int[np.ndarray, "n"],
                accepted: Int[np.ndarray, "n"]) -> None:
        """After the verify step: row i fed ``draft_lens[i]`` draft tokens (after the engine's
        cuts) of which the first ``accepted[i]`` were accepted."""
        ...
