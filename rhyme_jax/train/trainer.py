"""The GRPO trainer: rollout -> reward -> advantages -> clipped update, with exact resumption.

One step (ARCHITECTURE.md section 3): ``prompts_per_step`` prompts, each sampled
``samples_per_prompt`` times by the paged rollout engine; rewards from the task verifier; group
advantages; ``minibatches`` clipped-surrogate updates; metrics, the step's rollouts and (every
``checkpoint_every`` steps) an Orbax checkpoint with params, optimizer state, step and RNG.

Determinism: the prompts of step s and its sampling key are functions of (seed, s) only, so a run
resumed from step k replays steps k+1.. exactly as an uninterrupted run would.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from rhyme_jax.config import to_dict
from rhyme_jax.data import Problem, load_problems
from rhyme_jax.data.rewards import reward_fn as reward_of
from rhyme_jax.parallel import distributed
from rhyme_jax.parallel.mesh import MeshConfigError, rollout_meshes, train_mesh
from rhyme_jax.parallel.reshard import put_global, reshard, to_host
from rhyme_jax.parallel.rules import batch_sharding, opt_state_shardings, param_shardings
from rhyme_jax.rollout.engine import RolloutEngine
from rhyme_jax.sched import carry
from rhyme_jax.sched.scheduler import RolloutScheduler
from rhyme_jax.sched.timeline import load_schedule, plot_gantt, write_schedule
from rhyme_jax.spec.drafter import Drafter
from rhyme_jax.spec.history import HistoryStore
from rhyme_jax.train import checkpoint as ckpt
from rhyme_jax.train.evaluate import EvalResult, evaluate_run
from rhyme_jax.train.grpo_step import TrainShardings, UpdateMemory, make_grpo_step, make_logprob_fn
from rhyme_jax.train.losses import group_advantages, response_grid, sequence_batch
from rhyme_jax.train.metrics import MetricsWriter, NullMetricsWriter
from rhyme_jax.train.optim import make_optimizer
from rhyme_jax.train.pipeline import RolloutPipeline
from rhyme_jax.train.policy import build_sharded, build_tokenizer, eos_ids
from rhyme_jax.io.rollout_log import save_rollouts

SEQ_BUCKET = 64  # training sequence lengths are padded to a multiple of this (bounded recompiles)


class RunExistsError(RuntimeError):
    """A fresh (non ``--resume``) GRPO run would overwrite a run directory that has checkpoints."""


def has_checkpoints(run_dir: Path) -> bool:
    """Whether ``<run_dir>/checkpoints`` holds any step directory."""
    ck = Path(run_dir) / "checkpoints"
    return ck.is_dir() and any(p.name.isdigit() for p in ck.iterdir())


class NonFiniteLossError(RuntimeError):
    """Too many consecutive GRPO steps had a non-finite loss; the last good checkpoint is kept."""


def run_dir_of(cfg: Any) -> Path:
    """``<run.runs_dir>/<run.name>``."""
    return Path(cfg.run.runs_dir) / cfg.run.name


def make_engine(graphdef: nnx.GraphDef, model_cfg, cfg: Any, eos: tuple[int, ...],
                mesh: jax.sharding.Mesh | None = None) -> RolloutEngine:
    """The rollout engine of a run, sized by the ``rollout`` config section, on ``mesh`` (a rollout
    worker's sub-mesh with a ``tensor`` axis; None = one device)."""
    r = cfg.rollout
    return RolloutEngine(graphdef, model_cfg, max_slots=r.max_slots, page_size=r.page_size,
                         num_pages=r.num_pages, max_prompt_len=r.max_prompt_len,
                         max_new_tokens=r.max_new_tokens, eos_ids=eos,
                         on_overlong_prompt=r.on_overlong_prompt, attention_impl=r.attention_impl,
                         max_verify_tokens=r.max_verify_tokens, share_prompt_prefix=r.share_prompt_prefix,
                         mesh=mesh)


def eval_path(run_dir: Path, step: int) -> Path:
    """Per-problem results of the held-out evaluation after ``step`` GRPO steps (0 = before)."""
    return Path(run_dir) / "eval" / f"step_{step:06d}.npz"


def num_grpo_prompts(cfg: Any, num_train: int) -> int:
    """Size of the prompt set GRPO cycles over: ``grpo.num_prompts`` (0 = all train problems)."""
    return min(num_train, cfg.grpo.num_prompts or num_train)


def epoch_of_step(cfg: Any, num_train: int, step: int) -> int:
    """1-based epoch (pass over the GRPO prompt set) in which step ``step`` starts."""
    return (step - 1) * int(cfg.grpo.prompts_per_step) // num_grpo_prompts(cfg, num_train) + 1


def prompt_schedule(seed: int, num_problems: int, step: int, per_step: int) -> np.ndarray:
    """Indices of the train problems used at GRPO ``step`` (1-based): consecutive slices of
    per-epoch permutations seeded by (seed, epoch). Pure function of its arguments."""
    start = (step - 1) * per_step
    out = []
    while len(out) < per_step:
        epoch, offset = divmod(start + len(out), num_problems)
        perm = np.random.default_rng([seed, epoch]).permutation(num_problems)
        take = min(per_step - len(out), num_problems - offset)
        out.extend(perm[offset:offset + take].tolist())
    return np.asarray(out, dtype=np.int64)


class GRPOTrainer:
    """GRPO over the paged rollout engine (``rhyme-jax train``).

    Args:
      cfg: run config (``rhyme_jax.config.load_config``).
      resume: continue from the newest checkpoint in ``<run_dir>/checkpoints``.
      reward_fn: ``(response_text, problem) -> float`` (the verifier; tests may inject faults);
        default: the reward of ``data.answer_extraction``.

    Raises:
      NonFiniteLossError: ``grpo.max_consecutive_nonfinite`` consecutive non-finite steps.
    """

    def __init__(self, cfg: Any, *, resume: bool = False,
                 reward_fn: Callable[[str, Problem], float] | None = None):
        self.cfg = cfg
        self.reward_fn = reward_fn or reward_of(cfg.data.answer_extraction)
        distributed.initialize(cfg.parallel)  # no-op unless multi-host is configured
        self.primary = jax.process_index() == 0  # only process 0 writes files (Orbax: all save)
        # Layouts first: a mesh that does not fit the devices fails before anything is written.
        p, g = cfg.parallel, cfg.grpo
        self.mesh = train_mesh(p.data, p.fsdp, p.tensor)
        self._check_batch_layout()
        self.worker_meshes = rollout_meshes(p.rollout_tensor, p.rollout_workers)
        self.run_dir = run_dir_of(cfg)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.primary:
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg))))
        self.train_problems, self.eval_problems = load_problems(cfg.data)
        self.tokenizer = build_tokenizer(cfg, self.run_dir, self.train_problems)
        # Train layout: params and optimizer state created directly in their shardings.
        self.graphdef, state, self.model_cfg = build_sharded(cfg, self.tokenizer, cfg.run.seed, self.mesh)
        param_sh = param_shardings(state, self.mesh)
        warm = self._warm_start_dir()
        if warm is not None:
            state = ckpt.load_params(warm, state)
        self.optimizer = make_optimizer(g.learning_rate, g.steps, g.warmup_steps, g.weight_decay,
                                        g.max_grad_norm, schedule=g.schedule)
        opt_sh = opt_state_shardings(self.optimizer, jax.eval_shape(self.optimizer.init, state),
                                     param_sh, self.mesh)
        opt_state = jax.jit(self.optimizer.init, out_shardings=opt_sh)(state)
        self.layout = TrainShardings(self.mesh, param_sh, opt_sh, batch_sharding(self.mesh))
        # The frozen KL reference is the starting policy (warm start or init), rebuilt on resume.
        self.ref_state = jax.tree.map(jnp.copy, state) if g.kl_coef > 0 else None
        # Rollout layout: data-parallel workers, each an engine on its own sub-mesh.
        eos = eos_ids(self.model_cfg, self.tokenizer)
        self.engines = [make_engine(self.graphdef, self.model_cfg, cfg, eos, mesh=m) for m in self.worker_meshes]
        self.engine = self.engines[0]
        self.rollout_shardings = [param_shardings(state, m) for m in self.worker_meshes]
        self.scheduler = RolloutScheduler(self.engines, cfg.sched, cfg.rollout.max_new_tokens)
        # The history store feeds HistoSpec's drafts and HistoPipe's length predictions.
        uses_history = cfg.spec.enabled or cfg.sched.mode == "histopipe"
        self.history = HistoryStore(cfg.spec.history_depth) if uses_history else None
        self.step_fn = make_grpo_step(self.graphdef, self.optimizer, eps_low=g.eps_low,
                                      eps_high=g.eps_high, kl_coef=g.kl_coef, loss_agg=g.loss_agg,
                                      temperature=cfg.rollout.temperature, shardings=self.layout,
                                      memory=UpdateMemory(g.micro_batch_tokens, g.logit_chunk, g.remat))
        self.ref_logprob_fn = make_logprob_fn(self.graphdef, cfg.rollout.temperature, self.layout,
                                              logit_chunk=g.logit_chunk)
        self.checkpointer = ckpt.Checkpointer(self.run_dir / "checkpoints", keep=cfg.run.keep_checkpoints)
        self.step, self.nonfinite_total, self.nonfinite_run = 0, 0, 0
        self.eval_before: Optional[dict] = None
        if resume and self.checkpointer.latest_step() is not None:
            # Restored into this run's shardings, whatever mesh the checkpoint was written on.
            state, opt_state, meta = self.checkpointer.restore(None, params_like=state,
                                                               opt_state_like=opt_state)
            self.step = int(meta["step"])
            self.nonfinite_total = int(meta.get("nonfinite_total", 0))
            self.nonfinite_run = int(meta.get("nonfinite_run", 0))
            self.eval_before = meta.get("eval_before")
            blobs = self.checkpointer.restore_blobs(self.step)
        else:
            blobs = {}
        if self.history is not None and "history" in blobs:
            self.history = HistoryStore.from_bytes(blobs["history"], source=f"checkpoint step {self.step}")
        self.drafter = Drafter(cfg.spec, self.history) if cfg.spec.enabled else None
        n_prompts = num_grpo_prompts(cfg, len(self.train_problems))
        self.pipeline = RolloutPipeline(
            cfg, self.scheduler, lambda s: prompt_schedule(cfg.run.seed, n_prompts, s, g.prompts_per_step),
            self._prompt_ids, self.rollout_states, history=self.history, drafter=self.drafter)
        if "carry" in blobs:  # one_step_off groups waiting for their deferred samples
            self.pipeline.carry = carry.from_bytes(blobs["carry"], source=f"checkpoint step {self.step}")
        if self.drafter is not None and len(self.history):
            self.drafter.rebuild(self.history.prompt_ids())
        # Commit every array to its sharding: restored and freshly built arrays then look the same
        # to jit, so the update compiles once.
        self.state, self.opt_state = reshard((state, opt_state), (param_sh, opt_sh))
        truncate = self.step + 1 if resume else None
        self.metrics = (MetricsWriter(self.run_dir, truncate_from=truncate) if self.primary
                        else NullMetricsWriter())
        self._prompt_cache: dict[int, list[int]] = {}

    @property
    def batch_shards(self) -> int:
        """Row shards of a train batch: ``parallel.data x parallel.fsdp``."""
        return int(np.prod([self.mesh.shape[a] for a in ("data", "fsdp")]))

    def _check_batch_layout(self) -> None:
        g = self.cfg.grpo
        shards = self.batch_shards
        rows = g.prompts_per_step * g.samples_per_prompt
        if rows % (g.minibatches * shards):
            raise MeshConfigError(
                f"grpo.prompts_per_step * grpo.samples_per_prompt = {rows} rows must split into "
                f"grpo.minibatches={g.minibatches} minibatches of a multiple of parallel.data x "
                f"parallel.fsdp = {shards} rows")

    def rollout_states(self, state: nnx.State | None = None) -> list[nnx.State]:
        """``state`` (default: the current params) in every local rollout worker's layout."""
        state = self.state if state is None else state
        return [reshard(state, sh) for sh in self.rollout_shardings]

    def _warm_start_dir(self) -> Optional[Path]:
        if self.cfg.run.init_from:
            path = Path(self.cfg.run.init_from)
            if not path.exists():
                raise FileNotFoundError(f"run.init_from: no checkpoint at {path}")
            return path
        own = self.run_dir / "sft" / "params"
        return own if own.exists() else None

    # ------------------------------------------------------------------ one step
    def _prompt_ids(self, idx: int) -> list[int]:
        if idx not in self._prompt_cache:
            p = self.train_problems[idx]
            self._prompt_cache[idx] = self.tokenizer.encode(
                self.tokenizer.format_prompt(self.cfg.model.prompt_template, p.question))
        return self._prompt_cache[idx]

    def train_step(self, step: int) -> dict[str, float]:
        """Run GRPO step ``step`` (1-based) and return its metrics.

        The rollout comes from ``self.pipeline`` (``train/pipeline.py``): under
        ``sched.pipeline=sync`` it uses the current params; under ``one_step_off`` it was started
        during the previous step with the params before that step's update (staleness 1; after a
        resume the first rollout runs synchronously; with ``sched.cross_step`` it was queued on the
        workers right after update s - 2). Deferred tails (one_step_off + HistoPipe migration) move
        their group to the next rollout submitted (s + 1, or s + 2 with cross-step queues).
        """
        cfg, g = self.cfg, self.cfg.grpo
        n = g.samples_per_prompt
        sb, t_wait = self.pipeline.take(step, self.state)
        sr, t_rollout, groups = sb.rollout, sb.seconds, sb.groups
        out = sr.result
        ids = np.array([grp.prompt_idx for grp in groups for _ in range(n)], np.int64)
        prompts = [grp.prompt.tolist() for grp in groups for _ in range(n)]
        tokens = [t for grp in groups for t in grp.tokens]
        logprobs = [lp for grp in groups for lp in grp.logprobs]
        problems = [self.train_problems[int(i)] for i in ids]
        texts = [self.tokenizer.decode(t) for t in tokens]
        # Prompts over rollout.max_prompt_len (on_overlong_prompt=skip) come back with an empty
        # response: reward 0 without asking the verifier, and no loss (their loss_mask is all 0).
        skipped = np.array([f == "skipped" for grp in groups for f in grp.finish], bool)
        rewards = np.array([0.0 if skip else self.reward_fn(s, p)
                            for s, p, skip in zip(texts, problems, skipped)], np.float32)
        if self.primary:
            save_rollouts(self.run_dir, step, ids, tokens, rewards, logprobs)
            write_schedule(self.run_dir, step, sr.intervals, sr.group_finish_s, sr.plan)
        if self.history is not None:  # write-back, then rebuild those indexes off the critical path
            self.history.update(step, ids, [np.asarray(p, np.int32) for p in prompts], tokens, rewards)
            if self.drafter is not None:
                self.drafter.rebuild(np.unique(ids).tolist())
        self.pipeline.after_write_back(step, self.state)

        t1 = time.perf_counter()
        mb_metrics = self._update(prompts, tokens, logprobs, rewards) if groups else []
        t2 = time.perf_counter()
        t_train = t2 - t1
        self.pipeline.after_update(step, self.state, (t1, t2))

        finite = all(m["finite"] > 0 for m in mb_metrics)
        self.nonfinite_run = 0 if finite else self.nonfinite_run + 1
        self.nonfinite_total += 0 if finite else 1
        lengths = np.array([len(t) for t in tokens] or [0])
        metrics = {k: float(np.mean([m[k] for m in mb_metrics])) for k in (mb_metrics[0] if mb_metrics else {})}
        metrics.update({
            "rollout/trained_groups": float(len(groups)),
            "rollout/carried_groups": float(len(sb.carry)),
            "reward/mean": float(np.nanmean(rewards)) if np.isfinite(rewards).any() else float("nan"),
            "reward/accuracy": float(np.mean(rewards == 1.0)) if rewards.size else float("nan"),
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "time/rollout_s": t_rollout, "time/train_s": t_train, "time/rollout_wait_s": t_wait,
            "rollout/weights_step": float(sb.weights_step),
            "rollout/staleness": float(step - 1 - sb.weights_step),
            **sr.metrics,
            "rollout/tokens_per_s": float(out.stats["generated_tokens"] / max(t_rollout, 1e-9)),
            "rollout/forward_passes": float(out.stats["forward_passes"]),
            "rollout/workers": float(out.stats["workers"]),
            "rollout/max_worker_forward_passes": float(out.stats["max_worker_forward_passes"]),
            "rollout/decode_steps": float(out.stats["decode_steps"]),
            "rollout/generated_tokens": float(out.stats["generated_tokens"]),
            "rollout/tokens_per_forward": float(out.stats["tokens_per_forward"]),
            "rollout/epoch": float(epoch_of_step(cfg, len(self.train_problems), step)),
            "spec/drafted_tokens": float(out.stats["drafted_tokens"]),
            "spec/accepted_tokens": float(out.stats["accepted_tokens"]),
            "spec/acceptance_rate": float(out.stats["acceptance_rate"]),
            "spec/drafting_s": float(out.stats["drafting_seconds"]),
            "spec/drafting_share": float(out.stats["drafting_seconds"] / max(t_rollout, 1e-9)),
            "rollout/preemptions": float(out.stats.get("preemptions", 0)),
            "rollout/skipped": float(skipped.sum()),
            "nonfinite/skipped_total": float(self.nonfinite_total),
        })
        return metrics

    def _update(self, prompts: list[list[int]], tokens: list[np.ndarray], logprobs: list[np.ndarray],
                rewards: np.ndarray) -> list[dict]:
        """``grpo.minibatches`` clipped-surrogate updates on complete groups (n consecutive rows
        each); returns each minibatch's metrics. Rows are padded to a multiple of minibatches x
        (data x fsdp) with rows that carry no loss (only carried groups change the row count)."""
        g = self.cfg.grpo
        adv = np.asarray(group_advantages(jnp.asarray(rewards.reshape(-1, g.samples_per_prompt)),
                                          scale_by_std=g.scale_by_std)).reshape(-1)
        longest = max(len(p) + len(t) for p, t in zip(prompts, tokens))
        T = int(math.ceil(longest / SEQ_BUCKET) * SEQ_BUCKET)
        batch = sequence_batch(prompts, [t.tolist() for t in tokens], self.tokenizer.pad_id, max_len=T)
        batch["old_logprobs"] = response_grid(logprobs, batch.pop("prompt_lens"), T)
        batch.pop("lengths")
        batch["advantages"] = adv.astype(np.float32)
        multiple = g.minibatches * self.batch_shards
        pad = -len(prompts) % multiple
        if pad:
            batch = {k: np.concatenate([v, np.full((pad,) + v.shape[1:], self.tokenizer.pad_id if k == "tokens"
                                                   else 0, v.dtype)]) for k, v in batch.items()}
        if self.ref_state is not None:
            ref = self.ref_logprob_fn(self.ref_state, put_global(batch, self.layout.batch))
            batch["ref_logprobs"] = to_host(ref)
        out = []
        for mb in np.array_split(np.arange(len(prompts) + pad), g.minibatches):
            sub = put_global({k: v[mb] for k, v in batch.items()}, self.layout.batch)
            self.state, self.opt_state, m = self.step_fn(self.state, self.opt_state, sub)
            out.append(jax.device_get(m))
        return out

    # ------------------------------------------------------------------ loop
    def evaluate(self, problems=None) -> EvalResult:
        """Held-out accuracy (greedy, and mean@k when ``run.eval_samples``) of the current policy."""
        self.pipeline.wait()
        return evaluate_run(self.engine, self.rollout_states()[0], self.tokenizer,
                            problems or self.eval_problems, self.cfg)  # the task reward, never an injected one

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
        if self.primary:
            plot_gantt(load_schedule(self.run_dir), self.run_dir / "gantt.png",
                       num_workers=self.scheduler.local, title=f"rollout workers ({cfg.sched.mode})")
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
