"""Decoder shape and numerics: ``ModelConfig``, read from / written to HF ``config.json``.

Supported HF families (``model_type``): ``qwen2`` (Qwen2 / Qwen2.5), ``qwen3`` (dense Qwen3) and
``llama`` (Llama 2 / 3 / 3.1 / 3.2). Both the transformers 4.x layout (``rope_theta`` +
``rope_scaling``) and the 5.x layout (``rope_parameters``) of the RoPE fields are read.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FAMILIES = ("qwen2", "qwen3", "llama")
_LLAMA3_KEYS = ("factor", "high_freq_factor", "low_freq_factor", "original_max_position_embeddings")
_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


class ModelConfigError(ValueError):
    """A model configuration is invalid; the message names the source (file) and the field."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (pre-norm, RoPE, GQA, SwiGLU).

    Attributes:
      family: ``"qwen2"`` | ``"qwen3"`` | ``"llama"``.
      vocab_size: rows of the embedding / columns of the output head.
      hidden_size: model width D.
      intermediate_size: SwiGLU width.
      num_layers: decoder layers.
      num_heads: query heads H.
      num_kv_heads: key/value heads (GQA); divides ``num_heads``.
      head_dim: per-head width (Qwen3 sets it independently of D / H).
      rms_norm_eps: RMSNorm epsilon.
      rope_theta: RoPE base.
      rope_scaling: ``None`` or the llama3 scaling as a sorted tuple of ``(key, value)`` pairs with
        keys ``factor, high_freq_factor, low_freq_factor, original_max_position_embeddings,
        rope_type`` (hashable, so the config can be a static jit argument).
      tie_word_embeddings: output head shares the embedding matrix.
      attention_bias: q/k/v projections carry biases (forced True for qwen2). For llama / qwen3 the
        HF flag also puts a bias on o_proj; see ``o_bias``.
      qk_norm: RMSNorm over head_dim on q and k before RoPE (forced True for qwen3, an error for
        the other families).
      max_position_embeddings: longest supported position (informational; not enforced here).
      bos_token_id: BOS id or None.
      eos_token_ids: ids that end a generation (from ``eos_token_id``, int or list).
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        src = "ModelConfig"
        if self.family not in FAMILIES:
            raise ModelConfigError(f"{src}: field 'family'={self.family!r} is not one of {FAMILIES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelConfigError(f"{src}: field {name!r}={value!r} must be a positive int")
        # Family-implied architecture flags (HF hard-codes them): qwen2 always has q/k/v biases,
        # qwen3 always has q/k norms. Forced here so a hand-built config saves and reloads the same.
        if self.family == "qwen2":
            object.__setattr__(self, "attention_bias", True)
        if self.family == "qwen3":
            object.__setattr__(self, "qk_norm", True)
        elif self.qk_norm:
            raise ModelConfigError(f"{src}: field 'qk_norm'=True is only valid for family 'qwen3'")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"{src}: field 'num_kv_heads'={self.num_kv_heads} must divide num_heads={self.num_heads}")
        if self.rope_scaling is not None:
            keys = tuple(k for k, _ in self.rope_scaling)
            if keys != tuple(sorted(_LLAMA3_KEYS + ("rope_type",))) or dict(self.rope_scaling)["rope_type"] != "llama3":
                raise ModelConfigError(
                    f"{src}: field 'rope_scaling'={self.rope_scaling!r} must be the sorted llama3 pairs "
                    f"{sorted(_LLAMA3_KEYS + ('rope_type',))}")
        if not isinstance(self.eos_token_ids, tuple):
            raise ModelConfigError(f"{src}: field 'eos_token_ids' must be a tuple of ints")

    @property
    def o_bias(self) -> bool:
        """Whether o_proj has a bias (HF llama / qwen3 tie it to ``attention_bias``; qwen2 never)."""
        return self.attention_bias and self.family != "qwen2"

    @property
    def rope_scaling_dict(self) -> dict | None:
        """``rope_scaling`` as a plain dict (or None)."""
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        """Build from a HF ``config.json`` mapping.

        Args:
          d: the parsed JSON object.
          source: name used in error messages (usually the file path).

        Raises:
          ModelConfigError: unknown ``model_type``, a required field missing or of the wrong type,
            unsupported features (non-SiLU activation, sliding window, MLP bias, non-llama3 RoPE
            scaling); the message names ``source`` and the field.
        """
        if not isinstance(d, dict):
            raise ModelConfigError(f"{source}: top level must be a JSON object")

        def need(field: str, kind=int):
            if field not in d or d[field] is None:
                raise ModelConfigError(f"{source}: required field {field!r} is missing")
            return _typed(d[field], kind, source, field)

        def opt(field: str, default, kind):
            value = d.get(field)
            return default if value is None else _typed(value, kind, source, field)

        family = d.get("model_type")
        if family not in FAMILIES:
            raise ModelConfigError(
                f"{source}: field 'model_type'={family!r} is not supported (expected one of {FAMILIES})")
        if d.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"{source}: field 'hidden_act'={d['hidden_act']!r}: only 'silu' is supported")
        if d.get("mlp_bias"):
            raise ModelConfigError(f"{source}: field 'mlp_bias'=true is not supported")
        if d.get("use_sliding_window"):
            raise ModelConfigError(f"{source}: field 'use_sliding_window'=true is not supported")

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        head_dim = opt("head_dim", None, int)
        if head_dim is None:
            if hidden % heads:
                raise ModelConfigError(f"{source}: field 'head_dim' missing and hidden_size % num_attention_heads != 0")
            head_dim = hidden // heads
        theta, scaling = _rope_fields(d, source)
        eos = d.get("eos_token_id")
        if eos is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos, list):
            eos_ids = tuple(_typed(e, int, source, "eos_token_id") for e in eos)
        else:
            eos_ids = (_typed(eos, int, source, "eos_token_id"),)

        if family == "qwen2":
            attention_bias = True
        else:
            attention_bias = opt("attention_bias", False, bool)
        try:
            return cls(
                family=family,
                vocab_size=need("vocab_size"),
                hidden_size=hidden,
                intermediate_size=need("intermediate_size"),
                num_layers=need("num_hidden_layers"),
                num_heads=heads,
                num_kv_heads=opt("num_key_value_heads", heads, int),
                head_dim=head_dim,
                rms_norm_eps=opt("rms_norm_eps", 1e-6, float),
                rope_theta=theta,
                rope_scaling=scaling,
                tie_word_embeddings=opt("tie_word_embeddings", False, bool),
                attention_bias=attention_bias,
                qk_norm=family == "qwen3",
                max_position_embeddings=opt("max_position_embeddings", 4096, int),
                bos_token_id=opt("bos_token_id", None, int),
                eos_token_ids=eos_ids,
            )
        except ModelConfigError as exc:
            raise ModelConfigError(f"{source}: {exc}") from None

    @classmethod
    def from_hf_dir(cls, path) -> "ModelConfig":
        """Read ``<path>/config.json`` (``path`` may also be the file itself).

        Raises:
          ModelConfigError: the file is missing, not JSON, or invalid (see ``from_hf_dict``).
        """
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ModelConfigError(f"{file}: config file not found")
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{file}: not valid JSON: {exc}") from None
        return cls.from_hf_dict(data, source=str(file))

    def to_hf_dict(self) -> dict:
        """HF ``config.json`` mapping (transformers 5.x ``rope_parameters`` layout, also readable by
        ``from_hf_dict``). Inverse of ``from_hf_dict`` for every supported configuration."""
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope.update(self.rope_scaling_dict)
        out: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (list(self.eos_token_ids) if len(self.eos_token_ids) > 1
                             else (self.eos_token_ids[0] if self.eos_token_ids else None)),
        }
        if self.family == "qwen2":
            out["use_sliding_window"] = False
        else:
            out["attention_bias"] = self.attention_bias
        if self.family == "llama":
            out["mlp_bias"] = False
        return out

    def replace(self, **changes) -> "ModelConfig":
        """Copy with some fields changed (validated again)."""
        return ModelConfig(**{**asdict(self), **changes})


def _typed(value, kind, source: str, field: str):
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelConfigError(f"{source}: field {field!r}={value!r} must be an int")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelConfigError(f"{source}: field {field!r}={value!r} must be a number")
        return float(value)
    if kind is bool:
        if not isinstance(value, bool):
            raise ModelConfigError(f"{source}: field {field!r}={value!r} must be true/false")
        return value
    raise TypeError(kind)


def _rope_fields(d: dict, source: str) -> tuple[float, tuple | None]:
    """(rope_theta, llama3 scaling tuple or None) from either HF RoPE layout."""
    params = d.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params, field = d.get("rope_scaling"), "rope_scaling"
    if params is not None and not isinstance(params, dict):
        raise ModelConfigError(f"{source}: field {field!r} must be an object")
    params = dict(params or {})
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    theta = _typed(theta, float, source, "rope_theta")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ModelConfigError(
            f"{source}: field '{field}.rope_type'={rope_type!r} is not supported (only default and llama3)")
    pairs = []
    for key in _LLAMA3_KEYS:
        if key not in params:
            raise ModelConfigError(f"{source}: field '{field}.{key}' is missing for llama3 RoPE scaling")
        kind = int if key == "original_max_position_embeddings" else float
        pairs.append((key, _typed(params[key], kind, source, f"{field}.{key}")))
    pairs.append(("rope_type", "llama3"))
    return theta, tuple(sorted(pairs))
