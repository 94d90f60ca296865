"""Time the GRPO update of a step a run logged: its rows, its minibatches, its packing.

A run keeps each step's responses (``<run>/rollouts/step_NNNNNN.npz``, ``io.rollout_log``) and its
config (``<run>/config.yaml``). ``time_logged_update`` rebuilds what the trainer's update of that
step computes on (``train.trainer.Trainer._update``): the prompts' tokens, the responses, the
``grpo.minibatches`` contiguous slices, each right-padded (``losses.sequence_batch``) and then
packed as the config packs (``grpo.pack_lengths`` class calls, else ``grpo.padding_free``), and
times the whole step's optimizer steps on the run's architecture and decoder options with random
weights and random behaviour logprobs (time and memory do not depend on their values). The
advantages are the logged rewards' group advantages and truncated rows lose their loss under
``grpo.mask_truncated_completions``, so the rows the trainer leaves out of the buffers (no loss
tokens; advantage 0 under ``grpo.skip_zero_advantage_rows``) stay out here too. Config overrides
(``grpo.remat=false``, ``model.attention_block=256``) time the same rows under other settings. ``python -m benchmarks.update_step --run-dir RUN --step N`` is the command
line.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from rhyme_jax.config import load_config
from rhyme_jax.data import load_problems
from rhyme_jax.io.rollout_log import load_rollouts
from rhyme_jax.train.length_classes import update_calls
from rhyme_jax.train.losses import group_advantages
from rhyme_jax.train.memory_plan import model_config_of
from rhyme_jax.train.optim import grpo_optimizer
from rhyme_jax.train.overlong import mask_rows
from rhyme_jax.train.policy import build_tokenizer, tiny_model_config
from rhyme_jax.train.prompts import PromptTokens
from rhyme_jax.train.trainer import update_order
from rhyme_lab.ablate.update_cost import random_state
from rhyme_lab.measure.packed_update import _steps, minibatch


def logged_calls(cfg, run_dir: Path, step: int) -> tuple[list[list[dict]], object, int]:
    """``(calls per optimizer step, model config, rows)``: each optimizer step's list of packed
    calls (one dict per jitted call; one dict without ``grpo.pack_lengths``) for the rows of
    ``step``."""
    train, _ = load_problems(cfg.data)
    tok = build_tokenizer(cfg, run_dir, train)
    model_cfg = model_config_of(cfg, "")[0] if cfg.model.path else tiny_model_config(cfg, tok)
    logged = load_rollouts(run_dir, step)
    prompt = PromptTokens(tok, train, cfg.model.prompt_template)
    prompts = [prompt(i) for i in logged["prompt_ids"]]
    responses = [r.tolist() for r in logged["responses"]]
    g, rng, out = cfg.grpo, np.random.default_rng(0), []
    groups = jnp.asarray(logged["rewards"], jnp.float32).reshape(-1, g.samples_per_prompt)
    adv = np.asarray(group_advantages(groups, scale_rewards=g.scale_rewards)).reshape(-1)
    truncated = np.asarray(logged["lengths"]) >= cfg.rollout.max_new_tokens
    for rows in update_order(len(prompts), g.minibatches, g.num_iterations):
        b = minibatch([prompts[i] for i in rows], [responses[i] for i in rows], rng)
        b["advantages"] = adv[rows].astype(np.float32)
        if g.mask_truncated_completions:
            b["loss_mask"] = mask_rows(b["loss_mask"], truncated[rows])
        out.append(update_calls(b, g))
    return out, model_cfg, len(prompts)


def time_logged_update(run_dir: str | Path, step: int, overrides: list[str] = (), repeats: int = 2) -> dict:
    """Time the update of logged step ``step`` of run ``run_dir`` under its config plus ``overrides``.

    Returns ``{"run_dir", "step", "overrides", "rows", "real_tokens", "calls"`` (each call's
    ``[rows, length]``), ``"first_s"`` (the first update: compiles included), ``"step_s"`` (median
    seconds of ``repeats`` more, each from fresh copies of the weights and optimizer state),
    ``"temp_bytes"`` (XLA's temporaries of the largest one-call program) ``}``.

    Raises:
      RolloutLogError: the step's rollouts are missing or unreadable.
      ConfigError: the run's config (with ``overrides``) is invalid.
    """
    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml", list(overrides))
    per_step, model_cfg, rows = logged_calls(cfg, run_dir, step)
    graphdef, state = random_state(model_cfg, jnp.dtype(cfg.model.dtype), cfg.model.decoder_options())
    one, accumulate = _steps(cfg, graphdef)
    opt_state = jax.jit(grpo_optimizer(cfg.grpo).init)(state)
    dev = [[{k: jnp.asarray(v) for k, v in c.items()} for c in calls] for calls in per_step]

    def update() -> float:
        s, o = jax.tree.map(jnp.copy, state), jax.tree.map(jnp.copy, opt_state)
        jax.block_until_ready((s, o))
        t0 = time.perf_counter()
        for calls in dev:
            s, o, m = accumulate(s, o, calls)
        jax.block_until_ready(m)
        return time.perf_counter() - t0

    times = [update() for _ in range(repeats + 1)]
    shapes = {c["tokens"].shape: c for calls in dev for c in calls}
    temp = max(int(one.lower(state, opt_state, c).compile().memory_analysis().temp_size_in_bytes)
               for c in shapes.values())
    return {"run_dir": str(run_dir), "step": step, "overrides": list(overrides),
            "rows": rows,
            "real_tokens": int(sum(np.count_nonzero(c["attn_mask"]) for calls in per_step for c in calls)),
            "calls": [[list(c["tokens"].shape) for c in calls] for calls in per_step],
            "first_s": round(times[0], 3), "step_s": round(float(np.median(times[1:])), 3), "temp_bytes": temp}
