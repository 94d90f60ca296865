"""Capture the policy's modes along a learning run (``measure.policy_mode``), step by step.

Reruns a saved run's config (HistoSpec off: with the per-position draws a run samples the same
tokens whatever drafts it, so the plain run is every spec run's workload) and, right before each
GRPO update, teacher-forces the step's rollouts through the behaviour weights (the weights that
sampled them under ``sched.pipeline=sync``): the argmax and its probability at every response
position go to ``<run>/policy_modes/step_%06d.npz`` beside the run's rollouts. The log-probability
of each sampled token is checked against the behaviour logprobs the rollout recorded (a mismatch
means the forward is not the sampler's policy). ``cut_bound_run`` then replays the policy's own
greedy drafts beside the run's drafter and the oracle.

Source: issue 32 (the targets' bound); ``measure.policy_mode``.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Int

from rhyme_jax.train.callbacks import TrainerCallback
from rhyme_jax.train.losses import sequence_batch
from rhyme_lab.measure.policy_mode import save_modes


class CaptureError(ValueError):
    """A config the capture cannot rerun as its rollouts were sampled (names the field)."""


def mode_fn(graphdef: nnx.GraphDef, temperature: float):
    """Jitted ``(state, tokens, positions, mask) -> (argmax, p_mode, logp)`` of a right-padded
    batch ``int32[B, T]`` (``mask`` bool, True on real tokens): for each column ``t < T - 1`` the
    policy's most likely next token (``int32[B, T-1]``), its probability under
    ``softmax(logits / temperature)`` (``float32[B, T-1]``) and the log-probability of the
    batch's own next token ``tokens[:, t + 1]`` (``float32[B, T-1]``, to check against the
    behaviour logprobs).

    Raises:
      ValueError: ``temperature <= 0``.
    """
    if temperature <= 0:
        raise ValueError(f"policy_modes.mode_fn: temperature must be > 0, got {temperature}")

    def run(state: nnx.State, tokens: Int[Array, "B T"], positions: Int[Array, "B T"],
            mask: Bool[Array, "B T"]):
        model = nnx.merge(graphdef, state)
        h = model.hidden(tokens, positions, mask)[:, :-1]
        logp = jax.nn.log_softmax(model.unembed(h).astype(jnp.float32) / temperature, axis=-1)
        own = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        return jnp.argmax(logp, axis=-1).astype(jnp.int32), jnp.exp(jnp.max(logp, axis=-1)), own

    return jax.jit(run)


def policy_modes(fn, state: nnx.State, prompts: list[np.ndarray], responses: list[np.ndarray], pad_id: int,
                 rows: int = 8) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per row, at each response position ``j`` (the policy's view of ``response[j]`` given the
    prompt and ``response[:j]``): ``(argmax int32[t], p_mode float32[t], logp float32[t])``
    (``mode_fn``'s outputs), ``rows`` rows per forward (memory: ``rows x T x vocab`` floats),
    right-padded by ``train.losses.sequence_batch``.

    Raises:
      SequenceBatchError: a prompt is empty or the counts differ."""
    out = []
    for lo in range(0, len(prompts), rows):
        ps, rs = prompts[lo: lo + rows], responses[lo: lo + rows]
        batch = sequence_batch([list(p) for p in ps], [list(r) for r in rs], pad_id)
        got = [np.asarray(x) for x in fn(state, batch["tokens"], batch["positions"], batch["attn_mask"])]
        for b, (p, r) in enumerate(zip(ps, rs)):
            at = slice(len(p) - 1, len(p) - 1 + len(r))
            out.append(tuple(x[b, at] for x in got))
    return out


def check_config(cfg) -> None:
    """The capture needs the behaviour weights at update time: ``sched.pipeline=sync``.

    Raises:
      CaptureError: another pipeline (its rollouts were sampled with older weights).
    """
    if cfg.sched.pipeline != "sync":
        raise CaptureError(f"sched.pipeline={cfg.sched.pipeline!r}: the capture needs 'sync' (the weights "
                           "at update time are then the behaviour weights)")


def step_stats(modes: list, responses: list[np.ndarray], behaviour: list[np.ndarray]) -> dict:
    """One step's figures: tokens after each row's first (the drafted positions), the share of
    them that are the policy's argmax, their mean mode probability, and the largest
    |teacher-forced - behaviour| logprob of a sampled token."""
    tail = [(m[0][1:], m[1][1:], r[1:]) for m, r in zip(modes, responses)]
    n = sum(t[2].size for t in tail)
    hits = sum(int(np.sum(a == np.asarray(r))) for a, _, r in tail)
    p = sum(float(np.sum(pm)) for _, pm, _ in tail)
    worst = max((float(np.max(np.abs(m[2] - np.asarray(b)))) for m, b in zip(modes, behaviour) if len(b)),
                default=0.0)
    return {"tokens": n, "argmax_share": hits / max(n, 1), "p_mode": p / max(n, 1), "max_logp_diff": worst}


class ModeCapture(TrainerCallback):
    """The capture's callback: ``on_before_update`` teacher-forces the step's rollouts through
    the params the update starts from, saves the modes (``measure.policy_mode.save_modes``) and
    appends the step's ``step_stats`` with ``step`` and ``reward`` to ``out``.

    Args:
      temperature: the run's ``rollout.temperature``; rows: rollouts per forward;
      out: where each step's figures go; log: one line per step.
    """

    def __init__(self, temperature: float, rows: int, out: list[dict], log: Callable[[str], None]):
        self.temperature, self.rows, self.out, self.log = temperature, rows, out, log
        self.fn = None

    def on_before_update(self, trainer, step, state, batch) -> None:
        self.fn = self.fn or mode_fn(trainer.policy.graphdef, self.temperature)
        got = policy_modes(self.fn, state, [np.asarray(p, np.int32) for p in batch.prompts], batch.tokens,
                           trainer.tokenizer.pad_id, self.rows)
        save_modes(trainer.run_dir, step, got)
        r = {"step": step, "reward": float(np.mean(batch.rewards)), **step_stats(got, batch.tokens, batch.logprobs)}
        self.out.append(r)
        self.log(f"step {r['step']}: reward {r['reward']:.3f}, argmax share {r['argmax_share']:.3f}, "
                 f"p_mode {r['p_mode']:.3f}, max |logp - behaviour| {r['max_logp_diff']:.2e}")


def capture(cfg, rows: int = 8, log: Callable[[str], None] = print) -> list[dict]:
    """Train ``cfg``'s ``grpo.steps`` steps (no evaluation, no checkpoints) and save the policy's
    modes of every step (module docstring; ``ModeCapture``); returns each step's ``step_stats``
    with ``step`` and ``reward``. ``rows``: rollouts per teacher-forced forward.

    Raises:
      CaptureError: ``check_config``.
    """
    from rhyme_jax.train.trainer import GRPOTrainer

    check_config(cfg)
    out: list[dict] = []
    trainer = GRPOTrainer(cfg, callbacks=[ModeCapture(cfg.rollout.temperature, rows, out, log)])
    try:
        for step in range(trainer.step + 1, cfg.grpo.steps + 1):
            trainer.metrics.log(step, trainer.train_step(step), phase="train")
            trainer.step = step
    finally:
        trainer.close()
    return out
