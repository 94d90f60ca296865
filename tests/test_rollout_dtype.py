"""bf16 rollouts over float32 master weights (``rollout.dtype`` / ``EngineConfig.dtype``).

* float32 stays exact: an engine with ``dtype="float32"`` (or ``""``, as given) runs the very
  program of today's engine: the same graphdef object, a float32 pool, bit-identical tokens and
  logprobs.
* bfloat16: given the float32 master weights, the engine runs a bf16 copy on a graph computing
  in bf16 with bf16 KV pages. Checked against a dense (non-paged) forward of the same bf16 graph
  and weights, teacher-forced on the engine's tokens, and against the float32 forward.

Tolerances from bf16 rounding (unit roundoff ``u = 2**-8``: bf16 keeps 8 significant bits, round
to nearest). Every op of the bf16 forward rounds its output to bf16 (matmuls accumulate in f32;
attention scores, softmax and logits are f32), a relative error <= u each. With ``n`` such
roundings on the path from embedding to logits (``f32.decoder_widths`` lists them: one per
reduction) and independent, mean-zero errors, a bf16 program's logits are within
``dz = LAMBDA sqrt(n) u M`` of exact (the probabilistic bound of ``tests/f32.py`` with u for U,
LAMBDA = 7; ``M`` the largest |logit|, errors relative to the output scale as there), so
log_softmax within ``2 dz``. Two bf16 programs (the paged engine and the dense forward: they round
in different places, inside attention and in the residual stream once those differ) are within
twice that; a float32 program is exact at this scale (its own bound is ~1e5 times smaller). The
bound is loose (about a nat on this model with its x20 weights: it catches a wrong pool dtype,
position or page, not the last bit); that the engine computes the bf16 function and not the float32
one is checked by comparison (it is closer to the bf16 dense forward than to the float32 one), and
greedy tokens must agree with the teacher-forced argmax on most positions (ties at bf16
resolution may flip). The figures on SmolLM2 are measured by ``benchmarks/rollout_dtype.py``
(docs/results.md).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import f32
from test_rollout_engine import CFG, MAX_PROMPT, _engine, _model, _prompts

from rhyme_jax.config import load_config
from rhyme_jax.model.precision import cast_floating, with_compute_dtype
from rhyme_jax.rollout.engine import EngineConfig, EngineConfigError, SamplingParams
from rhyme_jax.train import losses

U_BF16 = 2.0 ** -8  # bfloat16 unit roundoff (8 significant bits)
NEW = 8  # tokens per response (fewer decode programs to compile than the engine's MAX_NEW)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW)


@functools.lru_cache(maxsize=None)
def _runs():
    """Greedy rollouts of the same prompts by engines in '' (as given), float32 and bfloat16,
    all given the float32 master weights."""
    _, state = _model()
    prompts = _prompts(0, lens=(3, 9, 14))
    out = {}
    for dtype in ("", "float32", "bfloat16"):
        eng = _engine(dtype=dtype)
        out[dtype] = (eng, eng.generate(state, prompts, GREEDY, jax.random.key(0)))
    return prompts, out


def _dense_logits(graphdef, state, prompts, responses):
    """Dense forward logits ``f32[B, T, V]`` of prompt + response rows, and the batch."""
    batch = losses.sequence_batch(prompts, [np.asarray(r).tolist() for r in responses], 0)
    model = nnx.merge(graphdef, state)
    logits = model(jnp.asarray(batch["tokens"]), jnp.asarray(batch["positions"]), jnp.asarray(batch["attn_mask"]))
    return np.asarray(logits), batch


def _response_rows(logits, batch, i, n):
    """Row ``i``'s logits at the ``n`` positions that predict its response tokens."""
    start = int(batch["prompt_lens"][i]) - 1
    return logits[i, start:start + n]


def test_float32_engine_is_todays_program():
    prompts, runs = _runs()
    base_eng, base = runs[""]
    eng, res = runs["float32"]
    assert base_eng.dtype is None and base_eng.kv.dtype == jnp.float32 and eng.kv.dtype == jnp.float32
    graphdef, state = _model()
    assert eng._graph(state) is graphdef  # the graph already computes in float32: the same program
    assert all(a is b for a, b in zip(jax.tree.leaves(eng._cast(state)), jax.tree.leaves(state)))  # no copy
    for a, b, la, lb in zip(base.tokens, res.tokens, base.logprobs, res.logprobs):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(la, lb)


def _bf16_logit_bound(max_abs_logit: float) -> float:
    """``dz``: one bf16 program's logits against exact (module docstring)."""
    n = len(f32.decoder_widths(CFG.num_layers, CFG.hidden_size, CFG.intermediate_size, CFG.num_heads,
                               CFG.head_dim, MAX_PROMPT + NEW))
    return f32.LAMBDA * math.sqrt(n) * U_BF16 * max_abs_logit


def _teacher_forced(graphdef, state, prompts, res):
    """Per row: ``(log_softmax of the response positions' logits, those logits)`` of a dense
    forward of prompt + the engine's response; and the largest |logit|."""
    logits, batch = _dense_logits(graphdef, state, prompts, res.tokens)
    rows = [_response_rows(logits, batch, i, len(t)) for i, t in enumerate(res.tokens)]
    lsm = [np.asarray(jax.nn.log_softmax(r, axis=-1)) for r in rows]
    return lsm, rows, float(np.abs(logits[batch["attn_mask"]]).max())


def test_bf16_engine_matches_a_bf16_dense_forward_of_the_same_weights():
    prompts, runs = _runs()
    eng, res = runs["bfloat16"]
    graphdef, state = _model()
    assert eng.kv.dtype == jnp.bfloat16
    g16, s16 = with_compute_dtype(graphdef, state, jnp.bfloat16), cast_floating(state, jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(s16)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(state)} == {jnp.dtype(jnp.float32)}  # the master weights stay f32
    lsm16, rows16, m = _teacher_forced(g16, s16, prompts, res)
    lsm32, _, _ = _teacher_forced(graphdef, state, prompts, res)
    tol = f32.between_programs(2 * _bf16_logit_bound(m))  # two bf16 programs' log_softmax
    agree = total = 0
    d16, d32 = [], []
    for toks, lps, l16, l32, r16 in zip(res.tokens, res.logprobs, lsm16, lsm32, rows16):
        at = np.arange(len(toks))
        d16.append(np.abs(lps - l16[at, toks]))
        d32.append(np.abs(lps - l32[at, toks]))
        assert d16[-1].max() <= tol
        top2 = np.sort(r16, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * tol
        np.testing.assert_array_equal(toks[clear], r16.argmax(-1)[clear])
        agree += int((toks == r16.argmax(-1)).sum())
        total += len(toks)
    assert agree > total / 2  # greedy = the bf16 argmax on most positions
    assert np.concatenate(d16).mean() < np.concatenate(d32).mean()  # it computes the bf16 function


def test_bf16_engine_is_within_bf16_rounding_of_float32():
    prompts, runs = _runs()
    _, res16 = runs["bfloat16"]
    _, res32 = runs["float32"]
    graphdef, state = _model()
    lsm32, _, m = _teacher_forced(graphdef, state, prompts, res16)  # float32, on the bf16 engine's tokens
    worst = max(float(np.abs(lps - l[np.arange(len(t)), t]).max())
                for t, lps, l in zip(res16.tokens, res16.logprobs, lsm32))
    assert worst <= 2 * _bf16_logit_bound(m)  # one bf16 program against a float32 one
    # bf16 really ran: its logprobs are not float32's (the float32 engine is within f32 rounding)
    assert worst > 10 * f32.logprobs(CFG, MAX_PROMPT + NEW, m)
    same = sum(int((a == b).sum()) for a, b in zip(res16.tokens, res32.tokens))
    assert same > 0.5 * sum(len(t) for t in res32.tokens)  # greedy agrees on most positions


def test_engine_and_run_config_dtype():
    with pytest.raises(EngineConfigError, match="dtype"):
        EngineConfig(max_slots=1, page_size=4, max_prompt_len=4, max_new_tokens=4, dtype="float16")
    cfg = load_config("configs/tiny_test.yaml", ["rollout.dtype=bfloat16"])
    assert EngineConfig.from_run(cfg).dtype == "bfloat16"
    assert EngineConfig.from_run(load_config("configs/tiny_test.yaml")).dtype == ""
    from rhyme_jax.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.dtype"):
        load_config("configs/tiny_test.yaml", ["rollout.dtype=float16"])
