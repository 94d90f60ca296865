"""The GRPO trainer: rollout -> reward -> advantages -> clipped update, with exact resumption.

One step (docs/architecture.md, "Data flow of one GRPO step"): ``prompts_per_step`` prompts, each sampled
``samples_per_prompt`` times by the paged rollout engine; rewards from the task verifier; group
advantages; ``num_iterations`` x ``minibatches`` clipped-surrogate updates; metrics, the step's
rollouts and (every ``checkpoint_every`` steps) an Orbax checkpoint with params, optimizer state,
step and RNG.
The run's parts (policy, rollout workers, learner, checkpoint, pipeline) come from
``train/assembly.py``.

Determinism: the prompts of step s and its sampling key are functions of (seed, s) only
(``train/prompts.py``), so a run resumed from step k replays steps k+1.. exactly as an
uninterrupted run would.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from rhyme_jax.data import Problem
from rhyme_jax.data.custom_reward import choose_reward, score_terms
from rhyme_jax.io.metrics import NullMetricsWriter
from rhyme_jax.io.rollout_log import save_rollouts
from rhyme_jax.io.summary import eval_path
from rhyme_jax.parallel.reshard import put_global, to_host
from rhyme_jax.sched import carry
from rhyme_jax.sched.timeline import write_schedule
from rhyme_jax.train.assembly import batch_shards, build_run
from rhyme_jax.train.callbacks import CallbackList, TrainerCallback, builtin_callbacks
from rhyme_jax.train.dynamic_sampling import fill_batch
from rhyme_jax.train.evaluate import EvalResult, evaluate_run
from rhyme_jax.train.losses import group_advantages, loss_normaliser, response_grid, sequence_batch
from rhyme_jax.train.overlong import mask_rows, soft_overlong_penalty
from rhyme_jax.train.length_classes import update_calls
from rhyme_jax.train.prompts import epoch_of_step, num_grpo_prompts
from rhyme_jax.train.reporting import metrics_writer
from rhyme_jax.train.tis import truncated_is_weights
from rhyme_jax.train.step_batch import StepBatch

if TYPE_CHECKING:
    from rhyme_jax.config import RunConfig

SEQ_BUCKET = 64  # training sequence lengths are padded to a multiple of this (bounded recompiles)


class RunExistsError(RuntimeError):
    """A fresh (non ``--resume``) GRPO run would overwrite a run directory that has checkpoints."""


def has_checkpoints(run_dir: Path) -> bool:
    """Whether ``<run_dir>/checkpoints`` holds any step directory."""
    ck = Path(run_dir) / "checkpoints"
    return ck.is_dir() and any(p.name.isdigit() for p in ck.iterdir())


class NonFiniteLossError(RuntimeError):
    """Too many consecutive GRPO steps had a non-finite loss; the last good checkpoint is kept."""




class GRPOTrainer:
    """GRPO over the paged rollout engine (``rhyme-jax train``).

    Args:
      cfg: run config (``rhyme_jax.config.load_config``).
      resume: continue from the newest checkpoint in ``<run_dir>/checkpoints``.
      reward_fn: ``(response_text, problem) -> float`` (the verifier; tests may inject faults);
        default: the config's reward (``reward.fn``, else the built-in reward of
        ``data.answer_extraction``; ``data.custom_reward``). Setting both is an error.
      callbacks: ``train.callbacks.TrainerCallback`` instances, the one way other code reaches
        into the run (events and rules: ``train/callbacks.py``); they run after the built-in
        ones (the Gantt plot).

    Raises:
      NonFiniteLossError: ``grpo.max_consecutive_nonfinite`` consecutive non-finite steps.
      RewardError: ``reward.fn`` cannot be used, or is set together with ``reward_fn`` (before
        any work), or returned a value that is not a finite number.
      MeshConfigError, FileNotFoundError, ValueError: from ``assembly.build_run``.
      TypeError: a callback is not a ``TrainerCallback``.
    """

    def __init__(self, cfg: RunConfig, *, resume: bool = False,
                 reward_fn: Callable[[str, Problem], float] | None = None,
                 callbacks: Sequence[TrainerCallback] = ()):
        self.cfg = cfg
        self.callbacks = CallbackList([*builtin_callbacks(), *callbacks])
        self.reward_fn = choose_reward(cfg, reward_fn)  # a bad reward.fn fails before any work
        run = build_run(cfg, resume=resume, callbacks=self.callbacks)
        self.primary, self.run_dir, self.policy, self.learner = run.primary, run.run_dir, run.policy, run.learner
        self.mesh, self.tokenizer = run.policy.mesh, run.policy.tokenizer
        self.train_problems, self.eval_problems = run.policy.train_problems, run.policy.eval_problems
        self.rollout, self.engines, self.engine = run.rollout, run.rollout.engines, run.rollout.engine
        self.scheduler, self.history, self.drafter = run.rollout.scheduler, run.rollout.history, run.rollout.drafter
        self.pipeline, self.checkpointer = run.pipeline, run.checkpointer
        self.state, self.opt_state = run.state, run.opt_state
        st = run.start
        self.step, self.nonfinite_total, self.nonfinite_run, self.eval_before = (
            st.step, st.nonfinite_total, st.nonfinite_run, st.eval_before)
        truncate = self.step + 1 if resume else None
        self.metrics = (metrics_writer(cfg, self.run_dir, truncate_from=truncate) if self.primary
                        else NullMetricsWriter())

    @property
    def batch_shards(self) -> int:
        """Row shards of a train batch: ``parallel.data x parallel.fsdp``."""
        return batch_shards(self.mesh)

    def rollout_states(self, state: nnx.State | None = None) -> list[nnx.State]:
        """``state`` (default: the current params) in every local rollout worker's layout."""
        return self.rollout.states(self.state if state is None else state)

    # ------------------------------------------------------------------ one step
    def train_step(self, step: int) -> dict[str, float]:
        """Run GRPO step ``step`` (1-based) and return its metrics.

        The rollout comes from ``self.pipeline`` (``train/pipeline.py``): under
        ``sched.pipeline=sync`` it uses the current params; under ``one_step_off`` it was started
        during the previous step with the params before that step's update (staleness 1; after a
        resume the first rollout runs synchronously; with ``sched.cross_step`` it was queued on the
        workers right after update s - 2). Deferred tails (one_step_off + HistoPipe migration) move
        their group to the next rollout submitted (s + 1, or s + 2 with cross-step queues).
        Fires the callbacks' ``on_rollout_end``, ``on_before_update``, ``on_update_end`` and
        ``on_step_end`` (``train/callbacks.py``).
        """
        sb, t_wait = self.pipeline.take(step, self.state)
        rewards, per_fn = self._rewards(sb)
        sb.set_rewards(rewards)
        scored, sb, ds_metrics = self._fill(step, sb)  # grpo.dynamic_sampling; off: scored is sb
        self.callbacks.fire("on_rollout_end", self, step, scored)
        self._write_back(step, scored)
        if sb.groups:
            self.callbacks.fire("on_before_update", self, step, self.state, sb)
        t1 = time.perf_counter()
        mb_metrics = self._update(sb) if sb.groups else []
        t2 = time.perf_counter()
        self.pipeline.after_update(step, self.state, (t1, t2))
        if sb.groups:
            self.callbacks.fire("on_update_end", self, step, self.state, mb_metrics)
        finite = all(m["finite"] > 0 for m in mb_metrics)
        self.nonfinite_run = 0 if finite else self.nonfinite_run + 1
        self.nonfinite_total += 0 if finite else 1
        epoch = epoch_of_step(self.cfg, len(self.train_problems), step)
        metrics = {**_step_metrics(step, sb, mb_metrics, t_wait, t2 - t1, epoch, self.nonfinite_total), **per_fn,
                   **ds_metrics, **_overlong_metrics(self.cfg, sb)}
        self.callbacks.fire("on_step_end", self, step, metrics)
        return metrics

    def _score(self, sb: StepBatch) -> tuple[np.ndarray, dict[str, float]]:
        """``float32[N]`` rewards of the step's rows, and with ``reward.fns`` each function's
        ``reward/<name>/mean`` over the scored rows (``{}`` with a single reward). Prompts over
        rollout.max_prompt_len (on_overlong_prompt=skip) come back with an empty response: reward 0
        without asking the verifier, and no loss (their loss_mask is all 0). The others are scored
        in one call (a batched reward.fn sees the step's responses at once)."""
        texts = [self.tokenizer.decode(t) for t in sb.tokens]
        scored = [k for k, skip in enumerate(sb.skipped) if not skip]
        rewards, per_fn = np.zeros(len(texts), np.float32), {}
        if scored:
            rewards[scored], per_fn = score_terms(self.reward_fn, [texts[k] for k in scored],
                                                  [self.train_problems[int(sb.ids[k])] for k in scored])
        return rewards, per_fn

    def _rewards(self, sb: StepBatch) -> tuple[np.ndarray, dict[str, float]]:
        """``_score`` with, under ``reward.soft_overlong_cache``, DAPO's soft overlong penalty of
        each row's length added to the ``float32[N]`` rewards (``train/overlong.py``)."""
        (rewards, per_fn), r = self._score(sb), self.cfg.reward
        if r.soft_overlong_cache:
            rewards = rewards + soft_overlong_penalty([len(t) for t in sb.tokens], self.cfg.rollout.max_new_tokens,
                                                      r.soft_overlong_cache, r.soft_overlong_factor)
        return rewards, per_fn

    def _fill(self, step: int, sb: StepBatch) -> tuple[StepBatch, StepBatch, dict[str, float]]:
        """``(scored, trained, metrics)``: with ``grpo.dynamic_sampling`` the groups of ``sb`` and
        its refill rounds, the ones to train and ``dynamic_sampling/*``
        (``train/dynamic_sampling.py``); off: ``(sb, sb, {})``."""
        g = self.cfg.grpo
        if not g.dynamic_sampling:
            return sb, sb, {}
        filled = fill_batch(sb, per_step=g.prompts_per_step, max_rounds=g.refill_rounds, seed=self.cfg.run.seed,
                            prompt_set=num_grpo_prompts(self.cfg, len(self.train_problems)),
                            rollout=lambda k, idx: self.pipeline.refill(step, self.state, idx, k),
                            score=lambda b: self._rewards(b)[0])
        return filled.scored, filled.trained, filled.metrics

    def _write_back(self, step: int, sb: StepBatch) -> None:
        """The step's rollouts and schedule on disk, its responses into the history store (then
        those prompts' indexes rebuilt off the critical path), and the pipeline told (one_step_off
        starts the next rollout now)."""
        sr = sb.rollout
        if self.primary:
            save_rollouts(self.run_dir, step, sb.ids, sb.tokens, sb.rewards, sb.logprobs)
            write_schedule(self.run_dir, step, sr.intervals, sr.group_finish_s, sr.plan)
        if self.history is not None:
            self.history.update(step, sb.ids, [np.asarray(p, np.int32) for p in sb.prompts], sb.tokens,
                                sb.rewards)
            if self.drafter is not None:
                self.drafter.rebuild(np.unique(sb.ids).tolist())
        self.pipeline.after_write_back(step, self.state)

    def _update(self, sb: StepBatch) -> list[dict]:
        """``grpo.num_iterations`` passes of ``grpo.minibatches`` clipped-surrogate updates on the
        scored batch's complete groups (n consecutive rows each), all against the rollout's
        behaviour logprobs; returns each update's metrics. Rows are padded to a multiple of
        minibatches x (data x fsdp) with rows that carry no loss (only carried groups change the
        row count)."""
        g = self.cfg.grpo
        prompts, tokens, logprobs = sb.prompts, sb.tokens, sb.logprobs
        adv = np.asarray(group_advantages(jnp.asarray(sb.group_rewards), scale_rewards=g.scale_rewards)).reshape(-1)
        longest = max(len(p) + len(t) for p, t in zip(prompts, tokens))
        T = int(math.ceil(longest / SEQ_BUCKET) * SEQ_BUCKET)
        batch = sequence_batch(prompts, [t.tolist() for t in tokens], self.tokenizer.pad_id, max_len=T)
        batch["old_logprobs"] = response_grid(logprobs, batch.pop("prompt_lens"), T)
        batch.pop("lengths")
        batch["advantages"] = adv.astype(np.float32)
        if g.mask_truncated_completions:  # no loss tokens on rows cut at max_new_tokens (train/overlong.py)
            batch["loss_mask"] = mask_rows(batch["loss_mask"], sb.truncated)
        norm = loss_normaliser(g.loss_agg, response_tokens=int(np.count_nonzero(batch["loss_mask"])), rows=len(prompts),
                               minibatches=g.minibatches, max_new_tokens=self.cfg.rollout.max_new_tokens)
        batch["loss_norm"] = np.full(len(prompts), norm, np.float32)  # padding rows below: 0
        multiple = g.minibatches * self.batch_shards
        pad = -len(prompts) % multiple
        if pad:
            batch = {k: np.concatenate([v, np.full((pad,) + v.shape[1:], self.tokenizer.pad_id if k == "tokens"
                                                   else 0, v.dtype)]) for k, v in batch.items()}
        ln = self.learner
        if ln.ref_state is not None:
            ref = ln.ref_logprob_fn(ln.ref_state, put_global(batch, ln.layout.batch))
            batch["ref_logprobs"] = to_host(ref)
        tis_metrics = self._truncated_is(batch) if g.tis else {}
        out = []
        for mb in update_order(len(prompts) + pad, g.minibatches, g.num_iterations):
            calls = update_calls({k: v[mb] for k, v in batch.items()}, g, self.batch_shards)
            sub = calls if g.pack_lengths else calls[0]  # class buffers: one jitted call each (train/length_classes.py)
            grid = sum(c["tokens"].size for c in calls)
            sub = put_global(sub, ln.layout.batch)
            self.state, self.opt_state, m = ln.step_fn(self.state, self.opt_state, sub)
            out.append(dict(jax.device_get(m), **{"update/grid_tokens": float(grid)}, **tis_metrics))
        return out

    def _truncated_is(self, batch: dict) -> dict[str, float]:
        """``grpo.tis``: the old logprobs recomputed by the trainer (the params before this step's
        first update, in ``model.dtype``, like the KL reference's) replace the sampler's in
        ``batch["old_logprobs"]``, and ``batch["is_weights"]`` = ``min(exp(trainer - sampler),
        grpo.tis_cap)`` on response tokens (``tis.truncated_is_weights``; TRL's
        ``vllm_importance_sampling_correction``). Returns the ``tis/*`` metrics (floats)."""
        ln = self.learner
        trainer_lp = to_host(ln.ref_logprob_fn(self.state, put_global(batch, ln.layout.batch)))
        weights, metrics = truncated_is_weights(trainer_lp, batch["old_logprobs"], batch["loss_mask"][:, :-1],
                                                self.cfg.grpo.tis_cap)
        batch["old_logprobs"] = trainer_lp.astype(np.float32)
        batch["is_weights"] = np.asarray(weights, np.float32)
        return {k: float(v) for k, v in metrics.items()}

    # ------------------------------------------------------------------ loop
    def evaluate(self, problems=None) -> EvalResult:
        """Held-out accuracy (greedy, and mean@k when ``run.eval_samples``) of the current policy."""
        self.pipeline.wait()
        return evaluate_run(self.engine, self.rollout_states()[0], self.tokenizer,
                            problems or self.eval_problems, self.cfg)  # the config's reward, never an injected one

    def record_eval(self, step: int, res: EvalResult, *, before: bool = False) -> None:
        """Log an evaluation's metrics and keep its per-problem results in ``eval/``."""
        if self.primary:
            res.save(eval_path(self.run_dir, step))
        if before:
            self.eval_before = res.as_metrics()
        self.metrics.log(step, res.as_metrics(), phase="eval")

    def save(self) -> None:
        """Checkpoint params, optimizer state and counters for exact resumption."""
        meta = {"step": self.step, "seed": int(self.cfg.run.seed),
                "data_position": self.step * int(self.cfg.grpo.prompts_per_step),
                "rng": [int(x) for x in jax.random.key_data(jax.random.key(self.cfg.run.seed))],
                "nonfinite_total": self.nonfinite_total, "nonfinite_run": self.nonfinite_run,
                "eval_before": self.eval_before}
        blobs = {"history": self.history.to_bytes()} if self.history is not None else {}
        pending = self.pipeline.pending_carry()
        if pending:  # groups whose deferred samples a later rollout continues
            blobs["carry"] = carry.to_bytes(pending)
        blobs = blobs or None
        self.checkpointer.save(self.step, params=self.state, opt_state=self.opt_state, meta=meta, blobs=blobs)

    def fit(self) -> dict:
        """Run (or finish) all ``grpo.steps`` steps; returns the run summary dict."""
        cfg = self.cfg
        total = cfg.grpo.steps
        if self.eval_before is None:
            self.record_eval(0, self.evaluate(), before=True)
        bar = tqdm(total=total, initial=self.step, desc="GRPO", unit="step",
                   disable=not cfg.run.progress, dynamic_ncols=True)
        history = []
        while self.step < total:
            step = self.step + 1
            m = self.train_step(step)
            self.step = step
            self.metrics.log(step, m, phase="train")
            history.append(m)
            bar.update(1)
            bar.set_postfix(reward=f"{m['reward/mean']:.3f}", len=f"{m['response_length/mean']:.0f}",
                            tok_s=f"{m['rollout/tokens_per_s']:.0f}")
            if self.nonfinite_run >= cfg.grpo.max_consecutive_nonfinite:
                bar.close()
                raise NonFiniteLossError(
                    f"{self.nonfinite_run} consecutive GRPO steps (last: step {step}) had a "
                    f"non-finite loss or gradient; stopped. Last good checkpoint: step "
                    f"{self.checkpointer.latest_step()} in {self.run_dir / 'checkpoints'}")
            if cfg.run.eval_every and step % cfg.run.eval_every == 0 and step < total:
                self.record_eval(step, self.evaluate())
            if step % cfg.run.checkpoint_every == 0 or step == total:
                self.save()
        bar.close()
        self.callbacks.fire("on_train_end", self)  # built-in: <run>/gantt.png
        after = self.evaluate()
        self.record_eval(total, after)
        self.metrics.close()
        return {"eval_before": self.eval_before, "eval_after": after.as_metrics(),
                "steps": total, "nonfinite_skipped": self.nonfinite_total}

    def close(self) -> None:
        self.pipeline.close()
        if self.drafter is not None:
            self.drafter.close()
        self.checkpointer.close()
        self.metrics.close()


def update_order(rows: int, minibatches: int, num_iterations: int) -> list[np.ndarray]:
    """The row indexes of a GRPO step's optimizer steps, in order: ``num_iterations`` passes over
    the same ``minibatches`` contiguous slices of ``range(rows)`` (``np.array_split``), each pass in
    the same order (TRL ``num_iterations``: every pass reuses the generation's behaviour
    logprobs).

    Returns:
      ``num_iterations x minibatches`` int64 arrays (``i64[rows / minibatches]`` each, the first
      ``rows % minibatches`` one longer).
    """
    return np.array_split(np.arange(rows), minibatches) * num_iterations


def _step_metrics(step: int, sb: StepBatch, mb_metrics: list[dict],
                  t_wait: float, t_train: float, epoch: int, nonfinite_total: int) -> dict[str, float]:
    """A GRPO step's metrics row: the update's (mean over its optimizer steps), rewards, lengths, times
    (seconds), weights version, the scheduler's ``sched/*`` and the rollout's counts and rates."""
    sr, t_rollout, rewards = sb.rollout, sb.seconds, sb.rewards
    stats = sr.result.stats
    lengths = np.array([len(t) for t in sb.tokens] or [0])
    metrics = {k: float(np.mean([m[k] for m in mb_metrics])) for k in (mb_metrics[0] if mb_metrics else {})}
    metrics.update({
        "rollout/trained_groups": float(len(sb.groups)),
        "rollout/carried_groups": float(len(sb.carry)),
        "reward/mean": float(np.nanmean(rewards)) if np.isfinite(rewards).any() else float("nan"),
        "reward/accuracy": float(np.mean(rewards == 1.0)) if rewards.size else float("nan"),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "time/rollout_s": t_rollout, "time/train_s": t_train, "time/rollout_wait_s": t_wait,
        "rollout/weights_step": float(sb.weights_step),
        "rollout/staleness": float(step - 1 - sb.weights_step),
        **sr.metrics,
        "rollout/tokens_per_s": float(stats["generated_tokens"] / max(t_rollout, 1e-9)),
        **{f"rollout/{k}": float(stats[k]) for k in ("forward_passes", "workers", "max_worker_forward_passes",
                                                      "decode_steps", "generated_tokens", "tokens_per_forward")},
        "rollout/epoch": float(epoch),
        "spec/drafted_tokens": float(stats["drafted_tokens"]),
        "spec/accepted_tokens": float(stats["accepted_tokens"]),
        "spec/acceptance_rate": float(stats["acceptance_rate"]),
        "spec/predicted_acceptance": float(stats.get("predicted_acceptance", 0.0)),
        "spec/drafting_s": float(stats["drafting_seconds"]),
        "spec/drafting_share": float(stats["drafting_seconds"] / max(t_rollout, 1e-9)),
        "rollout/preemptions": float(stats.get("preemptions", 0)),
        "rollout/skipped": float(sb.skipped.sum()),
        "nonfinite/skipped_total": float(nonfinite_total),
    })
    return metrics


def _overlong_metrics(cfg: RunConfig, sb: StepBatch) -> dict[str, float]:
    """``rollout/truncated_masked`` (with ``grpo.mask_truncated_completions``) and
    ``reward/overlong_penalty`` (with ``reward.soft_overlong_cache``) of the trained rows; {} when
    both are off."""
    out = {}
    if cfg.grpo.mask_truncated_completions:
        out["rollout/truncated_masked"] = float(sb.truncated.sum())
    if cfg.reward.soft_overlong_cache:
        pen = soft_overlong_penalty([len(t) for t in sb.tokens] or [0], cfg.rollout.max_new_tokens,
                                    cfg.reward.soft_overlong_cache, cfg.reward.soft_overlong_factor)
        out["reward/overlong_penalty"] = float(pen.mean())
    return out
