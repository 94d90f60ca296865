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


def compare(cfg: RunConfig, model_cfg, draws: list[tuple[list[list[int]], list[list[int]]]], *,
            repeats: int = 3, log=print) -> list[dict]:
    """Padded vs packed update for each draw of ``(prompts, responses)`` token lists.

    Returns per draw: ``rows``, ``real_tokens``, ``padded_slots`` / ``packed_slots`` (rows x
    length of each minibatch), ``padded_s`` / ``packed_s`` (median seconds of one update),
    ``padded_temp_bytes`` / ``packed_temp_bytes`` and the ratios ``speedup`` and ``memory_ratio``
    (packed / padded); with ``grpo.pack_lengths`` the same for the class calls (``classes_*``,
    ``classes_calls``: each call's ``[rows, length]``)."""
    g = cfg.grpo
    graphdef, state = nnx.split(Decoder(model_cfg, dtype=jnp.dtype(cfg.model.dtype), param_dtype=PARAM_DTYPE,
                                        rngs=nnx.Rngs(0)))
    opt = grpo_optimizer(g)
    opt_state = opt.init(state)
    step = make_grpo_step(graphdef, opt, eps_low=g.eps_low, eps_high=g.eps_high, kl_coef=0.0, loss_agg=g.loss_agg,
                          temperature=cfg.rollout.temperature,
                          memory=UpdateMemory(g.micro_batch_tokens, g.logit_chunk, g.remat))
    classes = make_accumulating_step(graphdef, opt, eps_low=g.eps_low, eps_high=g.eps_high, kl_coef=0.0,
                                     loss_agg=g.loss_agg, temperature=cfg.rollout.temperature,
                                     memory=UpdateMemory(g.micro_batch_tokens, g.logit_chunk, g.remat))
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
        if g.pack_lengths:
            calls = pack_by_length(padded, g.loss_agg, list(g.pack_lengths), g.micro_batch_tokens)
            cls_s, cls_m = _timed_calls(classes, step, state, opt_state, calls, repeats)
            r.update(classes_slots=int(sum(c["tokens"].size for c in calls)), classes_s=cls_s,
                     classes_temp_bytes=cls_m, classes_speedup=pad_s / cls_s, classes_memory_ratio=cls_m / pad_m,
                     classes_calls=[list(c["tokens"].shape) for c in calls])
        out.append(r)
        if log:
            log(f"{r['rows']} rows, {r['real_tokens']} tokens: padded {r['padded_slots']} slots {pad_s:.2f} s "
                f"{pad_m / 2**20:.0f} MiB | packed {r['packed_slots']} slots {pack_s:.2f} s {pack_m / 2**20:.0f} MiB "
                f"| {r['speedup']:.2f}x faster, {r['memory_ratio']:.2f} of the memory")
        if log and g.pack_lengths:
            log(f"  length classes: {r['classes_slots']} slots in {len(calls)} calls {cls_s:.2f} s "
                f"{cls_m / 2**20:.0f} MiB | {r['classes_speedup']:.2f}x faster than padded, "
                f"{r['classes_memory_ratio']:.2f} of the memory")
    return out
