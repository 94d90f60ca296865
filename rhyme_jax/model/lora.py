"""LoRA adapters on the decoder's attention and MLP projections (Flax NNX's ``nnx.LoRALinear``).

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv 2106.09685,
eq. 3) replaces a projection ``y = x W (+ b)`` (``W: [in, out]``, the ``nnx.Linear`` kernel) by

    y = x W (+ b) + (alpha / r) * dropout(x) A B,      A: [in, r], B: [r, out]

with ``W`` frozen and only ``A`` and ``B`` trained. As in PEFT's ``LoraLayer`` (the reference
implementation, ``peft/tuners/lora/layer.py``): ``A`` starts uniform in ``+-1 / sqrt(in)``
(``kaiming_uniform(a=sqrt(5))`` on PEFT's ``[r, in]`` weight), ``B`` at zero (so the adapted model
starts as the base model), the scaling is ``lora_alpha / r`` and dropout acts on the adapter's
input only. PEFT's ``lora_A.weight`` is ``A.T`` and ``lora_B.weight`` is ``B.T``.

The adapted layer is ``LoRALinear``, Flax's ``nnx.LoRALinear`` (kernel and bias where
``nnx.Linear`` has them, the adapter in its ``lora`` submodule as ``nnx.LoRAParam``s) plus PEFT's
scaling and dropout. ``lora_decoder`` builds a ``Decoder`` whose targeted projections are
``LoRALinear``: its state is the base ``Decoder``'s state (same paths, stacked ``[L, ...]``) plus
the adapters ``layers/<attn|mlp>/<name>/lora/lora_{a,b}: [L, in, r] / [L, r, out]`` (plus, with
dropout, one ``LoRADropoutKey`` per layer and projection). ``merge_adapters`` folds the adapters
into the base kernels, ``W + (alpha / r) A B``: a plain ``Decoder`` state for the rollout engine
and the export.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from rhyme_jax.config.sections import LORA_TARGETS
from rhyme_jax.model.config import ModelConfig
from rhyme_jax.model.layers import INIT_STD
from rhyme_jax.model.transformer import Decoder, DecoderLayer, stack_layers

# Projection name (config.sections.LORA_TARGETS) -> the DecoderLayer submodule holding it (HF / PEFT
# call these self_attn / mlp).
TARGETS: dict[str, str] = {n: "mlp" if n in ("gate_proj", "up_proj", "down_proj") else "attn" for n in LORA_TARGETS}
HF_PARENT = {"attn": "self_attn", "mlp": "mlp"}


class LoRAError(ValueError):
    """A LoRA setting cannot be applied (names the field)."""


class LoRASpec(NamedTuple):
    """What the adapters are (PEFT ``LoraConfig`` fields in brackets).

    Attributes:
      rank: ``r`` >= 1 (``r``).
      alpha: scaling numerator; the adapter's output is multiplied by ``alpha / rank``
        (``lora_alpha``).
      dropout: probability in [0, 1) of zeroing an input feature of the adapter in training
        (``lora_dropout``).
      targets: projection names, a subset of ``TARGETS`` (``target_modules``).
    """

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = tuple(TARGETS)

    @property
    def scale(self) -> float:
        """``alpha / rank`` (PEFT ``scaling``; rsLoRA off)."""
        return float(self.alpha) / int(self.rank)

    @classmethod
    def from_section(cls, section: Any) -> "LoRASpec":
        """The spec of a ``lora`` config section (``rank``, ``alpha``, ``dropout``, ``target_modules``)."""
        return cls(int(section.rank), float(section.alpha), float(section.dropout), tuple(section.target_modules))

    def check(self) -> "LoRASpec":
        """Returns self; raises ``LoRAError`` naming the ``lora.*`` field out of range."""
        if self.rank < 1:
            raise LoRAError(f"lora.rank={self.rank} must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise LoRAError(f"lora.dropout={self.dropout} must be in [0, 1)")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets:
            raise LoRAError(f"lora.target_modules={list(self.targets)} must be a non-empty subset of {list(TARGETS)}")
        return self


class LoRADropoutKey(nnx.Variable):
    """Raw ``jax.random`` key data (``uint32[2]`` per layer) of one adapter's dropout; set by the
    training step each optimizer step (``dropout_keys``), never trained."""


def peft_a_init(key, shape, dtype=jnp.float32) -> Float[Array, "in r"]:
    """PEFT's ``lora_A`` init on our ``[in, r]`` layout: ``U(-1/sqrt(in), 1/sqrt(in))``
    (``kaiming_uniform_(a=sqrt(5))``: gain ``sqrt(2 / 6)``, bound ``gain * sqrt(3 / fan_in)``)."""
    bound = 1.0 / math.sqrt(shape[-2])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


class LoRALinear(nnx.LoRALinear):
    """``nnx.LoRALinear`` with PEFT's scaling and dropout: ``x W + b + scale * dropout(x) A B``.

    Args:
      in_features, out_features, use_bias, dtype, param_dtype, rngs: as ``nnx.Linear``.
      spec: rank, alpha (``scale = alpha / rank``) and dropout rate.
      target_id: this projection's index in ``TARGETS`` (folded into the dropout key).

    The adapter computes in ``dtype`` like the kernel (its float32 params are cast). With
    ``spec.dropout > 0`` the layer holds a ``LoRADropoutKey`` and drops adapter inputs with it
    (inverted dropout, kept features scaled by ``1 / (1 - p)``, as ``torch.nn.Dropout``).
    """

    def __init__(self, in_features: int, out_features: int, *, spec: LoRASpec, target_id: int, use_bias: bool,
                 dtype, param_dtype, rngs: nnx.Rngs):
        super().__init__(in_features, out_features, lora_rank=spec.rank, lora_dtype=dtype,
                         lora_param_dtype=param_dtype, a_initializer=peft_a_init, use_bias=use_bias, dtype=dtype,
                         param_dtype=param_dtype, kernel_init=nnx.initializers.normal(INIT_STD),
                         bias_init=nnx.initializers.zeros_init(), rngs=rngs)
        self.scale = spec.scale
        self.rate = spec.dropout
        self.target_id = int(target_id)
        if self.rate > 0:
            self.dropout_key = LoRADropoutKey(jnp.zeros((2,), jnp.uint32))

    def __call__(self, x: Float[Array, "... in"], out_sharding=None) -> Float[Array, "... out"]:
        y = nnx.Linear.__call__(self, x, out_sharding=out_sharding)
        if self.rate > 0:
            key = jax.random.fold_in(jax.random.wrap_key_data(self.dropout_key[...]), self.target_id)
            keep = jax.random.bernoulli(key, 1.0 - self.rate, x.shape)
            x = jnp.where(keep, x / (1.0 - self.rate), jnp.zeros((), x.dtype)).astype(x.dtype)
        return y + (self.lora(x) * self.scale).astype(y.dtype)


def _attach(layer, spec: LoRASpec, dtype, param_dtype, rngs: nnx.Rngs) -> None:
    """Replace the targeted ``nnx.Linear``s of one ``DecoderLayer`` by ``LoRALinear``s."""
    for name in spec.targets:
        parent = getattr(layer, TARGETS[name])
        old = getattr(parent, name)
        setattr(parent, name, LoRALinear(old.in_features, old.out_features, spec=spec,
                                         target_id=list(TARGETS).index(name), use_bias=old.use_bias,
                                         dtype=dtype, param_dtype=param_dtype, rngs=rngs))


def lora_decoder(cfg: ModelConfig, spec: LoRASpec, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 scan_unroll: int = 1, attention_block: int = 0) -> Decoder:
    """An abstract (``nnx.eval_shape``) ``Decoder`` of ``cfg`` whose ``spec.targets`` projections
    are ``LoRALinear``; its state's non-adapter part has the base ``Decoder``'s paths and shapes.
    Use its graphdef with the base params and the adapters (``nnx.merge(graphdef, base,
    adapters[, keys])``).

    Raises:
      LoRAError: ``spec`` out of range (``LoRASpec.check``).
    """
    spec.check()

    def build():
        model = Decoder(cfg, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0), scan_unroll=scan_unroll,
                        attention_block=attention_block)
        layers = []
        for _ in range(cfg.num_layers):
            layer = DecoderLayer(cfg, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0))
            _attach(layer, spec, dtype, param_dtype, nnx.Rngs(0))
            layers.append(layer)
        model.layers = stack_layers(layers)
        return model

    return nnx.eval_shape(build)


def split_lora(model: Decoder) -> tuple[nnx.GraphDef, nnx.State, nnx.State, nnx.State]:
    """``(graphdef, adapters, dropout_keys, base)`` of a LoRA decoder: its ``nnx.LoRAParam``s, its
    ``LoRADropoutKey``s (empty without dropout) and everything else (the base params)."""
    return nnx.split(model, nnx.LoRAParam, LoRADropoutKey, ...)


def init_adapters(abstract: nnx.State, key: jax.Array) -> nnx.State:
    """Initial adapters of the shapes of ``abstract`` (``split_lora``'s adapters): every ``lora_a``
    ``U(+-1/sqrt(in))`` (``peft_a_init``, an independent key per leaf and layer), every ``lora_b``
    zero, float32 (the adapted model starts equal to the base model)."""
    flat = nnx.to_flat_state(abstract)
    out = []
    for i, (path, var) in enumerate(flat):
        shape, dtype = var.get_value().shape, var.get_value().dtype
        value = (peft_a_init(jax.random.fold_in(key, i), shape, dtype) if path[-1] == "lora_a"
                 else jnp.zeros(shape, dtype))
        out.append((path, var.replace(value=value)))
    return nnx.from_flat_state(out)


def dropout_keys(abstract: nnx.State, key: jax.Array) -> nnx.State:
    """Values for ``split_lora``'s dropout keys (each ``uint32[L, 2]``): layer ``l`` of leaf ``i``
    gets ``fold_in(fold_in(key, i), l)``, so every layer and projection drops its own features."""
    out = []
    for i, (path, var) in enumerate(nnx.to_flat_state(abstract)):
        n = var.get_value().shape[0]
        data = jax.vmap(lambda l: jax.random.key_data(jax.random.fold_in(jax.random.fold_in(key, i), l)))(
            jnp.arange(n))
        out.append((path, var.replace(value=data.astype(jnp.uint32))))
    return nnx.from_flat_state(out)


def adapter_pairs(adapters: nnx.State) -> dict[tuple, tuple[Any, Any]]:
    """``{kernel path: (A [L, in, r], B [L, r, out])}`` of an adapters state (values, not
    Variables); the kernel path is ``("layers", parent, name, "kernel")``."""
    flat = {path: var.get_value() for path, var in nnx.to_flat_state(adapters)}
    pairs = {}
    for path, a in flat.items():
        if path[-1] == "lora_a":
            pairs[path[:-2] + ("kernel",)] = (a, flat[path[:-1] + ("lora_b",)])
    return pairs


def merge_adapters(base: nnx.State, adapters: nnx.State, scale: float) -> nnx.State:
    """The base state with every adapted kernel replaced by ``W + scale * A B`` (float32
    accumulation, stored in ``W``'s dtype): a plain ``Decoder`` state (same tree as ``base``).

    Args:
      base: ``Decoder`` params, stacked ``[L, ...]``; kernels ``[L, in, out]``.
      adapters: ``split_lora``'s adapters (``[L, in, r]`` / ``[L, r, out]``).
      scale: ``LoRASpec.scale``.
    """
    pairs = adapter_pairs(adapters)
    out = []
    for path, var in nnx.to_flat_state(base):
        if path in pairs:
            a, b = pairs[path]
            w = var.get_value()
            delta = jnp.einsum("lir,lro->lio", a, b, preferred_element_type=jnp.float32)
            var = var.replace(value=(w.astype(jnp.float32) + scale * delta).astype(w.dtype))
        out.append((path, var))
    return nnx.from_flat_state(out)

