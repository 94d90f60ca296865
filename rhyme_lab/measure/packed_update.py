"""The padding-free update against the padded one on a long-tailed task's minibatches.

Each draw takes ``rows`` sequences of the task (prompt + worked solution, the lengths a GRPO
minibatch of that task holds once the policy has learnt the format), builds the right-padded
minibatch the trainer builds (``losses.sequence_batch``, length rounded up to 64) and its packed
form (``train.packing.pack_minibatch``), with ``grpo.pack_lengths`` also its calls of class-length
buffers (``train.length_classes.pack_by_length``, the accumulating update of
``train.accumulate``), and times one jitted GRPO update of each on the run's
model (random weights: the cost does not depend on them) under the run's ``grpo`` memory
settings (micro-batch token budget, remat, logit chunk). Per draw: the token slots each computes
on, the median seconds of an update, and XLA's compiled temporaries (``memory_analysis``) of
each program (for the class calls: the largest over the calls' shapes, each compiled as a one-call
update). ``python -m benchmarks.packed_update`` is the command line.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rhyme_jax.config import RunConfig
from rhyme_jax.model.transformer import Decoder
from rhyme_jax.train import losses
from rhyme_jax.train.grpo_step import UpdateMemory, make_grpo_step
from rhyme_jax.train.optim import PARAM_DTYPE, grpo_optimizer
from rhyme_jax.train.accumulate import make_accumulating_step
from rhyme_jax.train.length_classes import pack_by_length
from rhyme_jax.train.packing import pack_minibatch

SEQ_BUCKET = 64


def minibatch(prompts: list[list[int]], responses: list[list[int]], rng: np.random.Generator) -> dict:
    """The padded minibatch the trainer builds from these rows (random behaviour logprobs and
    advantages: the cost does not depend on them)."""
    longest = max(len(p) + len(r) for p, r in zip(prompts, responses))
    T = -(-longest // SEQ_BUCKET) * SEQ_BUCKET
    b = losses.sequence_batch(prompts, responses, 0, max_len=T)
    lps = [(-rng.random(len(r))).astype(np.float32).tolist() for r in responses]
    b["old_logprobs"] = losses.response_grid(lps, b.pop("prompt_lens"), T)
    b.pop("lengths")
    b["advantages"] = rng.standard_normal(len(prompts)).astype(np.float32)
    return b


def _timed(step, state, opt_state, batch, repeats: int) -> tuple[float, int]:
    """(median seconds of an update after the compile, XLA temporaries of the program)."""
    dev = {k: jnp.asarray(v) for k, v in batch.items()}
    temp = int(step.lower(state, opt_state, dev).compile().memory_analysis().temp_size_in_bytes)
    return _median_s(step, state, opt_state, dev, repeats), temp


def _median_s(step, state, opt_state, batch, repeats: int) -> float:
    """Median seconds of ``repeats`` updates after a first (compiling) one, each on fresh copies."""
    times = []
    for _ in range(repeats + 1):
        s, o = jax.tree.map(jnp.copy, state), jax.tree.map(jnp.copy, opt_state)
        t0 = time.perf_counter()
        jax.block_until_ready(step(s, o, batch))
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))


def _timed_calls(step, one_call, state, opt_state, calls: list[dict], repeats: int) -> tuple[float, int]:
    """``_timed`` for the accumulating update over ``calls`` (temporaries: the largest of the
    one-call updates ``one_call`` compiles for the calls' distinct shapes)."""
    dev = [{k: jnp.asarray(v) for k, v in c.items()} for c in calls]
    shapes = {c["tokens"].shape: c for c in dev}
    temp = max(int(one_call.lower(state, opt_state, c).compile().memory_analysis().temp_size_in_bytes)
               for c in shapes.values())
    return _median_s(step, state, opt_state, dev, repeats), temp


def _steps(cfg: RunConfig, graphdef) -> tuple:
    """(one-call GRPO update, accumulating update over class calls) of ``graphdef`` under the
    run's ``grpo`` memory settings."""
    g = cfg.grpo
    opt = grpo_optimizer(g)
    kw = dict(eps_low=g.eps_low, eps_high=g.eps_high, kl_coef=0.0, loss_agg=g.loss_agg,
              temperature=cfg.rollout.temperature, memory=UpdateMemory(g.micro_batch_tokens, g.logit_chunk, g.remat))
    return make_grpo_step(graphdef, opt, **kw), make_accumulating_step(graphdef, opt, **kw)


def compare(cfg: RunConfig, model_cfg, draws: list[tuple[list[list[int]], list[list[int]]]], *,
            repeats: int = 3, log=print) -> list[dict]:
    """Padded vs packed update for each draw of ``(prompts, responses)`` token lists.

    Returns per draw: ``rows``, ``real_tokens``, ``padded_slots`` / ``packed_slots`` (rows x
    length of each minibatch), ``padded_s`` / ``packed_s`` (median seconds of one update),
    ``padded_temp_bytes`` / ``packed_temp_bytes`` and the ratios ``speedup`` and ``memory_ratio``
    (packed / padded); with ``grpo.pack_lengths`` the same for the class calls (``classes_*``,
    ``classes_calls``: each call's ``[rows, length]``). All of these use dense attention. With
    ``model.attention_block`` also ``blocked_padded_*`` and ``blocked_classes_*`` (or
    ``blocked_packed_*`` without classes): the same batches with block-sparse attention
    (``model.blocked_attention``), their ratios still against the dense padded update."""
    g = cfg.grpo
    dense_model = Decoder(model_cfg, dtype=jnp.dtype(cfg.model.dtype), param_dtype=PARAM_DTYPE, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(dense_model)
    step, classes = _steps(cfg, graphdef)
    opt_state = grpo_optimizer(g).init(state)
    blocked = None
    if cfg.model.attention_block:
        dense_model.attention_block = cfg.model.attention_block
        blocked = _steps(cfg, nnx.split(dense_model)[0])
    rng = np.random.default_rng(0)
    out = []
    for prompts, responses in draws:
        padded = minibatch(prompts, responses, rng)
        packed = pack_minibatch(padded, g.loss_agg)
        pad_s, pad_m = _timed(step, state, opt_state, padded, repeats)
        pack_s, pack_m = _timed(step, state, opt_state, packed, repeats)
        r = {"rows": len(prompts), "real_tokens": int(padded["attn_mask"].sum()),
             "padded_slots": int(padded["tokens"].size), "packed_slots": int(packed["tokens"].size),
             "padded_s": pad_s, "packed_s": pack_s, "padded_temp_bytes": pad_m, "packed_temp_bytes": pack_m,
             "speedup": pad_s / pack_s, "memory_ratio": pack_m / pad_m}
        if log:
            log(f"{r['rows']} rows, {r['real_tokens']} tokens: padded {r['padded_slots']} slots {pad_s:.2f} s "
                f"{pad_m / 2**20:.0f} MiB | packed {r['packed_slots']} slots {pack_s:.2f} s {pack_m / 2**20:.0f} MiB "
                f"| {r['speedup']:.2f}x faster, {r['memory_ratio']:.2f} of the memory")
        calls = pack_by_length(padded, g.loss_agg, list(g.pack_lengths), g.micro_batch_tokens) if g.pack_lengths else None
        if calls:
            _record(r, "classes", _timed_calls(classes, step, state, opt_state, calls, repeats), calls, log)
        if blocked is not None:
            _record(r, "blocked_padded", _timed(blocked[0], state, opt_state, padded, repeats), [padded], log)
            if calls:
                _record(r, "blocked_classes", _timed_calls(blocked[1], blocked[0], state, opt_state, calls, repeats),
                        calls, log)
            else:
                _record(r, "blocked_packed", _timed(blocked[0], state, opt_state, packed, repeats), [packed], log)
        out.append(r)
    return out


def _record(r: dict, name: str, timed: tuple[float, int], calls: list[dict], log) -> None:
    """Store one layout's slots, seconds, temporaries and its ratios against the dense padded update."""
    seconds, temp = timed
    r.update({f"{name}_slots": int(sum(c["tokens"].size for c in calls)), f"{name}_s": seconds,
              f"{name}_temp_bytes": temp, f"{name}_speedup": r["padded_s"] / seconds,
              f"{name}_memory_ratio": temp / r["padded_temp_bytes"],
              f"{name}_calls": [list(c["tokens"].shape) for c in calls]})
    if log:
        log(f"  {name.replace('_', ' ')}: {r[f'{name}_slots']} slots in {len(calls)} calls {seconds:.2f} s "
            f"{temp / 2**20:.0f} MiB | {r[f'{name}_speedup']:.2f}x faster than padded, "
            f"{r[f'{name}_memory_ratio']:.2f} of the memory")
