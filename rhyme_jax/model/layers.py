"""Building blocks of the decoder: RMSNorm, attention projections, SwiGLU MLP (Flax NNX).

Numerics follow HF ``LlamaRMSNorm`` / ``Qwen2Attention`` / ``Qwen3Attention`` / ``LlamaMLP``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from rhyme_jax.model.config import ModelConfig
from rhyme_jax.model.rope import apply_rope

INIT_STD = 0.02
_init = nnx.initializers.normal(INIT_STD)


def dot_f32_accumulate(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kw):
    """``lax.dot_general`` accumulated in float32 and returned in the operands' dtype.

    What GPUs and TPUs do for bfloat16 operands anyway; XLA's CPU backend otherwise computes a
    bfloat16-output product by converting both operands to float32 first (a 32 x 576 x 1536
    product took 922 us that way against 442 us accumulated in float32, 2-core AMD EPYC with
    AVX512-BF16). float32 operands are unchanged."""
    out = jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                              preferred_element_type=jnp.float32 if preferred_element_type is None
                              else preferred_element_type, **kw)
    return out if preferred_element_type is not None else out.astype(jnp.result_type(lhs, rhs))


def linear(din: int, dout: int, *, bias: bool, dtype, param_dtype, rngs: nnx.Rngs) -> nnx.Linear:
    """``nnx.Linear`` with kernel ``[din, dout]`` ~ N(0, 0.02^2) and zero bias; its product
    accumulates in float32 (``dot_f32_accumulate``)."""
    return nnx.Linear(din, dout, use_bias=bias, dtype=dtype, param_dtype=param_dtype, dot_general=dot_f32_accumulate,
                      kernel_init=_init, bias_init=nnx.initializers.zeros_init(), rngs=rngs)


class RMSNorm(nnx.Module):
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last axis.

    The statistic is computed in float32; the normalised value is cast back to the compute dtype
    before the weight multiply (HF ``LlamaRMSNorm``). Param ``weight: [dim]`` initialised to ones.
    """

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32, param_dtype=jnp.float32):
        self.eps = eps
        self.dtype = dtype
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: Float[Array, "... dim"]) -> Float[Array, "... dim"]:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(self.dtype) * normed.astype(self.dtype)


class Attention(nnx.Module):
    """GQA projections around an (external) attention op.

    Params: ``q_proj [D, H*hd]``, ``k_proj/v_proj [D, KVH*hd]``, ``o_proj [H*hd, D]`` (``nnx.Linear``
    kernels, i.e. HF weights transposed); q/k/v biases when ``cfg.attention_bias``; o bias when
    ``cfg.o_bias``; ``q_norm/k_norm`` (RMSNorm over hd) when ``cfg.qk_norm``.
    """

    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        d, h, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = linear(d, h * hd, bias=cfg.attention_bias, **kw)
        self.k_proj = linear(d, kvh * hd, bias=cfg.attention_bias, **kw)
        self.v_proj = linear(d, kvh * hd, bias=cfg.attention_bias, **kw)
        self.o_proj = linear(h * hd, d, bias=cfg.o_bias, **kw)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        else:
            self.q_norm = self.k_norm = None

    def project_qkv(self, x: Float[Array, "... D"], positions: Int[Array, "..."]
                    ) -> tuple[Float[Array, "... H hd"], Float[Array, "... KVH hd"], Float[Array, "... KVH hd"]]:
        """Queries, keys and values of ``x`` at integer ``positions`` (same leading shape).

        Biases, qk-norm (qwen3) and RoPE are applied; v is not rotated. Attention scale is NOT
        applied (the attention op multiplies by ``head_dim ** -0.5``).
        """
        lead = x.shape[:-1]
        hd = self.cfg.head_dim
        q = self.q_proj(x).reshape(*lead, self.cfg.num_heads, hd)
        k = self.k_proj(x).reshape(*lead, self.cfg.num_kv_heads, hd)
        v = self.v_proj(x).reshape(*lead, self.cfg.num_kv_heads, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, positions, self.cfg), apply_rope(k, positions, self.cfg), v

    def project_out(self, o: Float[Array, "... H hd"]) -> Float[Array, "... D"]:
        """Merge heads and apply ``o_proj``."""
        return self.o_proj(o.reshape(*o.shape[:-2], self.cfg.num_heads * self.cfg.head_dim))


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; no biases (Llama / Qwen)."""

    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.up_proj = linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.down_proj = linear(cfg.intermediate_size, cfg.hidden_size, **kw)

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
