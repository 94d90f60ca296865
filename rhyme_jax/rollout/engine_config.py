"""The rollout engine's one configuration object: sizes, stop tokens and attention of a
``RolloutEngine`` (the model's ``ModelConfig`` and the device mesh are passed beside it).

A run builds it from its config in one place (``EngineConfig.from_run``, used by
``rhyme_jax.train.assembly.make_engine``); benchmarks and tests build it directly. What does not
depend on the model or the backend is checked here; the engine checks the rest (token ids
against the vocabulary, the KV pool against a full-length sequence, the attention
implementation on this backend, the mesh).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from rhyme_jax.model.precision import DTYPES
from rhyme_jax.rollout.layer_weights import LAYOUTS
from rhyme_jax.rollout.shapes import DEFAULT_PREFILL_TOKENS
from rhyme_jax.rollout.types import EngineConfigError

if TYPE_CHECKING:
    from rhyme_jax.config import RolloutSection, RunConfig

_WHERE = "rhyme_jax/rollout/engine.py"  # where the messages have always pointed: the engine's arguments


@dataclass(frozen=True)
class EngineConfig:
    """What sizes one ``RolloutEngine``.

    Attributes:
      max_slots: concurrent sequences (decode rows).
      page_size: tokens per KV page.
      max_prompt_len, max_new_tokens: limits in tokens (they size the page-table rows).
      eos_ids: token ids that end a sequence (emitted and kept in the response); ``()``: every
        response runs to ``max_new_tokens``. Stored as a tuple of ints.
      num_pages: KV pool size in pages including scratch page 0; 0 = ``max_slots`` full-length
        sequences + 1.
      on_overlong_prompt: ``"error"`` (raise ``PromptTooLongError``) or ``"skip"``.
      attention_impl: ragged paged attention implementation: a name, ``"auto"`` (kernel of the
        backend, ``live_pages`` on CPU) or an ordered list (``pallas_kernels/.../api.py``); resolved
        on the backend by the engine.
      max_prefill_tokens: token budget of one prefill pass (rounded up to a power of two, at least
        one full sequence); bounds the number of prefill shape buckets.
      max_verify_tokens: packed-token budget of one decode/verify pass (pending tokens plus drafts
        of all rows); 0 = ``4 * max_slots``. Longest drafts are cut first to fit.
      share_prompt_prefix: samples of the same prompt (a GRPO group) share the KV pages the
        prompt fills completely (vLLM-style prefix sharing; outputs are unchanged).
      passes_per_dispatch: plain decode passes run in one device call (``rollout/chunk.py``;
        1 = one pass per call). Same tokens; trades host time per pass for idle rows at chunk
        ends and pages reserved ahead.
      dtype: the dtype the engine computes in: ``"float32"`` | ``"bfloat16"`` (its graph set to
        compute in it, the weights it is given cast to it, the KV pool in it;
        ``model.precision``), or ``""``: as the graph and weights it is given (the run's
        ``model.dtype``).
      layer_weights: ``"auto"`` | ``"split"`` | ``"stacked"``: whether the passes read the
        blocks' weights as ``L`` separate arrays (a layer loop without weight slices;
        ``rollout/layer_weights.py``) or through a scan over the stacked ones; ``"auto"`` splits
        on CPU where a block holds at least 4 MiB (``layer_weights.use_split``). Same tokens
        either way.

    Raises:
      EngineConfigError: ``max_slots``, ``page_size``, ``max_prompt_len``, ``max_new_tokens`` or
        ``passes_per_dispatch`` below 1, ``num_pages`` below 0, an unknown ``on_overlong_prompt``,
        ``dtype`` or ``layer_weights``; the message names the field.
    """

    max_slots: int
    page_size: int
    max_prompt_len: int
    max_new_tokens: int
    eos_ids: Sequence[int] = ()
    num_pages: int = 0
    on_overlong_prompt: str = "error"
    attention_impl: str | Sequence[str] = "reference"
    max_prefill_tokens: int = DEFAULT_PREFILL_TOKENS
    max_verify_tokens: int = 0
    share_prompt_prefix: bool = True
    passes_per_dispatch: int = 1
    dtype: str = ""
    draft_history: int = 1024
    row_buckets: Sequence[int] = ()
    layer_weights: str = "auto"

    def __post_init__(self):
        for name in ("max_slots", "page_size", "max_prompt_len", "max_new_tokens", "passes_per_dispatch",
                     "draft_history"):
            val = getattr(self, name)
            if int(val) < 1:
                raise EngineConfigError(f"{_WHERE}: RolloutEngine {name} must be >= 1, got {val}")
        if self.num_pages < 0:
            raise EngineConfigError(f"{_WHERE}: RolloutEngine num_pages must be >= 0, got {self.num_pages}")
        if self.on_overlong_prompt not in ("error", "skip"):
            raise EngineConfigError(
                f"{_WHERE}: on_overlong_prompt must be 'error' or 'skip', got {self.on_overlong_prompt!r}")
        if self.dtype not in ("", *DTYPES):
            raise EngineConfigError(f"{_WHERE}: dtype must be '' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.layer_weights not in LAYOUTS:
            raise EngineConfigError(
                f"{_WHERE}: layer_weights must be one of {list(LAYOUTS)}, got {self.layer_weights!r}")
        object.__setattr__(self, "eos_ids", tuple(int(e) for e in self.eos_ids))
        object.__setattr__(self, "row_buckets", tuple(int(b) for b in self.row_buckets))
        if any(b < 1 or b > self.max_slots for b in self.row_buckets):
            raise EngineConfigError(f"{_WHERE}: RolloutEngine row_buckets must lie in [1, max_slots={self.max_slots}], "
                                    f"got {list(self.row_buckets)}")
        if not isinstance(self.attention_impl, str):
            object.__setattr__(self, "attention_impl", tuple(self.attention_impl))

    @property
    def max_seq_len(self) -> int:
        """Tokens of a full-length sequence: ``max_prompt_len + max_new_tokens``."""
        return int(self.max_prompt_len) + int(self.max_new_tokens)

    @classmethod
    def from_section(cls, rollout: "RolloutSection", eos_ids: Sequence[int] = ()) -> "EngineConfig":
        """The engine a run's ``rollout`` config section sizes (``max_prefill_tokens``: the
        default, the section has no such key); ``eos_ids`` as the attribute; ``dtype`` is
        ``rollout.dtype`` (``""``: the run's ``model.dtype``, the dtype of its graph)."""
        r = rollout
        return cls(max_slots=r.max_slots, page_size=r.page_size, num_pages=r.num_pages,
                   max_prompt_len=r.max_prompt_len, max_new_tokens=r.max_new_tokens, eos_ids=tuple(eos_ids),
                   on_overlong_prompt=r.on_overlong_prompt, attention_impl=r.attention_impl,
                   max_verify_tokens=r.max_verify_tokens, share_prompt_prefix=r.share_prompt_prefix,
                   passes_per_dispatch=r.passes_per_dispatch, draft_history=r.draft_history,
                   dtype=r.dtype, row_buckets=tuple(r.row_buckets), layer_weights=r.layer_weights)

    @classmethod
    def from_run(cls, cfg: "RunConfig", eos_ids: Sequence[int] = ()) -> "EngineConfig":
        """``from_section(cfg.rollout, eos_ids)``: the engine config of a run (``eos_ids``: the
        stop tokens of its model and tokenizer, which the run config alone does not hold)."""
        return cls.from_section(cfg.rollout, eos_ids)


__all__ = ["EngineConfig"]
