"""One run assembly: the parts of a GRPO run, built in one place for the trainer, the CLI and the
benchmarks.

A run has three roles, built apart so that a caller builds only the roles it uses (the policy, the
rollout workers and the learner, as an RL cluster keeps its roles apart):

* ``Policy`` (``build_policy``): config, run directory, train / held-out problems, tokenizer and
  model definition, with the initial params in the train layout (``load_warm_start`` loads the
  params a GRPO run starts from);
* ``RolloutParts`` (``build_rollout``): one engine per rollout worker on its sub-mesh, each
  worker's param layout (the weight sync ``states``: the float32 master weights cast to the
  rollout dtype, ``rollout.dtype`` else ``model.dtype``, and resharded), the scheduler, the
  history store and the HistoSpec drafter. Benchmarks that only roll out stop here and never allocate training state;
* ``Learner`` (``build_learner``): optimizer (and its initial float32 state, schedule counted in
  optimizer steps: ``optim.grpo_optimizer``), the jitted update, the frozen KL reference.
  A LoRA run (``lora.rank > 0``, ``train/lora_state.py``) trains its adapters: the optimizer, the
  update and the checkpoints see the adapters only, the weight sync merges them into the base.

Params and optimizer state are returned next to the parts, never kept in them: the update donates
their buffers, so only their owner (the trainer) holds them.

``build_run`` assembles all three for ``GRPOTrainer``: layouts checked before anything is written,
the run directory and its config.yaml (written once the data, policy and warm start have loaded; a
fresh run directory is removed again when assembly fails), the warm start, the checkpoint restored on resume (params,
optimizer state, counters, history, carried groups) and the rollout pipeline wired to them.

Callbacks instead of method replacement: the ``wrap_generate`` of every
``train.callbacks.TrainerCallback`` given to ``build_rollout`` / ``build_run`` is installed around
every engine call the scheduler's workers make, and its ``wrap_submit`` around the start of every
step's rollout (``build_pipeline``); the other events are the trainer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from omegaconf import OmegaConf

from rhyme_jax.config import to_dict
from rhyme_jax.data import Problem, load_problems
from rhyme_jax.io import checkpoint as ckpt
from rhyme_jax.model.config import ModelConfig
from rhyme_jax.model.tokenizer import Tokenizer
from rhyme_jax.parallel import distributed
from rhyme_jax.parallel.mesh import MeshConfigError, rollout_meshes, train_mesh
from rhyme_jax.parallel.reshard import reshard
from rhyme_jax.parallel.rules import batch_sharding, opt_state_shardings, param_shardings
from rhyme_jax.rollout.engine import RolloutEngine
from rhyme_jax.rollout.engine_config import EngineConfig
from rhyme_jax.rollout.types import SamplingParams
from rhyme_jax.sched import carry
from rhyme_jax.sched.scheduler import RolloutScheduler
from rhyme_jax.spec.drafter import Drafter
from rhyme_jax.spec.history import HistoryStore
from rhyme_jax.train.callbacks import CallbackList, TrainerCallback
from rhyme_jax.train.accumulate import update_step_maker
from rhyme_jax.train.grpo_step import TrainShardings, UpdateMemory, loss_options, make_logprob_fn
from rhyme_jax.train.lora_state import LoRAParts, build_lora, lora_learner
from rhyme_jax.train.optim import grpo_optimizer
from rhyme_jax.train.pipeline import RolloutPipeline, make_pipeline
from rhyme_jax.train.policy import build_sharded, build_tokenizer, compute_params, eos_ids, rollout_dtype
from rhyme_jax.train.preflight import prepare
from rhyme_jax.train.prompts import PromptTokens, num_grpo_prompts, prompt_schedule

if TYPE_CHECKING:
    from rhyme_jax.config import RunConfig

def run_dir_of(cfg: RunConfig) -> Path:
    """``<run.runs_dir>/<run.name>``."""
    return Path(cfg.run.runs_dir) / cfg.run.name


def warm_start_dir(cfg: RunConfig, run_dir: Path) -> Optional[Path]:
    """Params a GRPO run starts from: ``run.init_from``, else ``<run_dir>/sft/params`` when
    present, else None (the freshly initialised policy).

    Raises:
      FileNotFoundError: ``run.init_from`` names a missing path.
    """
    if cfg.run.init_from:
        path = Path(cfg.run.init_from)
        if not path.exists():
            raise FileNotFoundError(f"run.init_from: no checkpoint at {path}")
        return path
    own = Path(run_dir) / "sft" / "params"
    return own if own.exists() else None


def make_engine(graphdef: nnx.GraphDef, model_cfg: ModelConfig, cfg: RunConfig, eos: Sequence[int],
                mesh: jax.sharding.Mesh | None = None) -> RolloutEngine:
    """The rollout engine of a run, sized by the ``rollout`` config section (``EngineConfig.from_run``),
    on ``mesh`` (a rollout worker's sub-mesh with a ``tensor`` axis; None = one device); ``eos``: token
    ids that end a response (``()``: every response runs to ``max_new_tokens``)."""
    return RolloutEngine(graphdef, model_cfg, EngineConfig.from_run(cfg, eos), mesh=mesh)


def batch_shards(mesh: jax.sharding.Mesh) -> int:
    """Row shards of a train batch on ``mesh``: its ``data x fsdp`` axes."""
    return int(np.prod([mesh.shape[a] for a in ("data", "fsdp")]))


def check_batch_layout(cfg: RunConfig, mesh: jax.sharding.Mesh) -> None:
    """Raises ``MeshConfigError`` unless a step's rows split into ``grpo.minibatches`` minibatches
    of a multiple of the mesh's row shards."""
    g, shards = cfg.grpo, batch_shards(mesh)
    rows = g.prompts_per_step * g.samples_per_prompt
    if rows % (g.minibatches * shards):
        raise MeshConfigError(
            f"grpo.prompts_per_step * grpo.samples_per_prompt = {rows} rows must split into "
            f"grpo.minibatches={g.minibatches} minibatches of a multiple of parallel.data x "
            f"parallel.fsdp = {shards} rows")


# ---------------------------------------------------------------------------------- policy
@dataclass(frozen=True)
class Policy:
    """The model a run trains (its definition, not its params) and what defines its inputs.

    Attributes:
      cfg: the run config; ``run_dir``: where the run writes (the demo tokenizer lives there).
      train_problems, eval_problems: the task's splits (``data`` section).
      tokenizer: the run's tokenizer; ``prompt_tokens``: train prompt index -> token ids.
      graphdef, model_cfg: the model definition; ``mesh``: the train mesh the params live on.
    """

    cfg: RunConfig
    run_dir: Path
    train_problems: list[Problem]
    eval_problems: list[Problem]
    tokenizer: Tokenizer
    prompt_tokens: PromptTokens
    graphdef: nnx.GraphDef
    model_cfg: ModelConfig
    mesh: jax.sharding.Mesh

    @property
    def eos(self) -> tuple[int, ...]:
        """Token ids that end a response (``policy.eos_ids``)."""
        return eos_ids(self.model_cfg, self.tokenizer)


def build_policy(cfg: RunConfig, run_dir: Path, mesh: jax.sharding.Mesh | None = None) -> tuple[Policy, nnx.State]:
    """Problems, tokenizer (the demo tokenizer is trained on first use and saved in ``run_dir``)
    and the policy created directly in its shardings on ``mesh`` (default: the train mesh of
    ``parallel``): a HF checkpoint (``model.path``) or the freshly initialised tiny model.
    Returns ``(policy, params)``."""
    mesh = train_mesh(cfg.parallel.data, cfg.parallel.fsdp, cfg.parallel.tensor) if mesh is None else mesh
    train, held_out = load_problems(cfg.data)
    tokenizer = build_tokenizer(cfg, Path(run_dir), train)
    graphdef, state, model_cfg = build_sharded(cfg, tokenizer, cfg.run.seed, mesh)
    policy = Policy(cfg, Path(run_dir), train, held_out, tokenizer,
                    PromptTokens(tokenizer, train, cfg.model.prompt_template), graphdef, model_cfg, mesh)
    return policy, state


def load_warm_start(cfg: RunConfig, run_dir: Path, state: nnx.State) -> nnx.State:
    """The params a GRPO run starts from (``warm_start_dir``) loaded into ``state``'s layout, or
    ``state`` itself when there are none.

    Raises:
      FileNotFoundError: ``run.init_from`` names a missing path.
    """
    warm = warm_start_dir(cfg, run_dir)
    return state if warm is None else ckpt.load_params(warm, state)


# ---------------------------------------------------------------------------------- rollout
def uses_history(cfg: RunConfig) -> bool:
    """Whether the run keeps a history store: HistoSpec drafts and HistoPipe length predictions
    both come from it."""
    return bool(cfg.spec.enabled) or cfg.sched.mode == "histopipe"


@dataclass
class RolloutParts:
    """The rollout side of a run.

    Attributes:
      engines: one ``RolloutEngine`` per local rollout worker (each on its sub-mesh).
      shardings: each worker's param shardings (``states`` reshards into them).
      scheduler: the ``RolloutScheduler`` over the engines (``sched`` section).
      history: the history store (None when neither HistoSpec nor HistoPipe is on).
      drafter: the HistoSpec drafter (None when ``spec.enabled`` is off).
      dtype: the dtype the workers' weights are cast to (``policy.rollout_dtype``: ``rollout.dtype``,
        else ``model.dtype``); None = kept as they are.
      merge: a LoRA run's ``adapters -> params`` (``LoRAParts.merge``: ``W + scale A B``), applied
        before the cast; None = the state is the params.
    """

    engines: list[RolloutEngine]
    shardings: list[Any]
    scheduler: RolloutScheduler
    history: Optional[HistoryStore]
    drafter: Optional[Drafter]
    dtype: Any = None
    merge: Optional[Callable] = None

    @property
    def engine(self) -> RolloutEngine:
        """The first local worker's engine (evaluation runs on it)."""
        return self.engines[0]

    def states(self, state: nnx.State) -> list[nnx.State]:
        """The weight sync: ``state`` (the float32 master weights) cast to the rollout dtype
        (``policy.compute_params``: once per sync, on the train mesh, before the copies) and
        resharded into every local worker's layout. The engines compute in that dtype either way
        (``rollout.dtype``, else ``model.dtype``); a bf16 copy halves each worker's weights and the
        bytes the sync moves. A LoRA run's ``state`` is its adapters: ``merge`` folds them into
        the base weights first (``train/lora_state.py``)."""
        if self.merge is not None:
            state = self.merge(state)
        if self.dtype is not None:
            state = compute_params(state, self.dtype)
        return [reshard(state, sh) for sh in self.shardings]

    def close(self) -> None:
        """Stop the scheduler's worker queues and the drafter's index thread."""
        self.scheduler.close()
        if self.drafter is not None:
            self.drafter.close()


def build_rollout(cfg: RunConfig, policy: Policy, params_like: nnx.State, *,
                  meshes: Sequence[jax.sharding.Mesh] | None = None, history: Optional[HistoryStore] = None,
                  callbacks: Sequence[TrainerCallback] = (), merge: Optional[Callable] = None) -> RolloutParts:
    """Engines, weight-sync layouts, scheduler, history store and drafter of a run.

    Args:
      params_like: the params (or a tree of the same structure) the workers' layouts are made for.
      meshes: the rollout workers' sub-meshes (default: ``parallel.rollout_tensor`` devices per
        worker, ``parallel.rollout_workers`` workers).
      history: a restored history store (default: an empty one when ``uses_history``).
      callbacks: their ``wrap_generate`` wraps every engine call of the scheduler's workers
        (``RolloutScheduler(wrap_generate=)``; the first callback innermost).
      merge: ``RolloutParts.merge`` (a LoRA run: ``params_like`` is then the base params).

    Raises:
      TypeError: a callback is not a ``TrainerCallback``.
    """
    p = cfg.parallel
    meshes = rollout_meshes(p.rollout_tensor, p.rollout_workers) if meshes is None else list(meshes)
    eos = policy.eos
    engines = [make_engine(policy.graphdef, policy.model_cfg, cfg, eos, mesh=m) for m in meshes]
    shardings = [param_shardings(params_like, m) for m in meshes]
    hooks = callbacks if isinstance(callbacks, CallbackList) else CallbackList(callbacks)
    scheduler = RolloutScheduler(engines, cfg.sched, cfg.rollout.max_new_tokens, wrap_generate=hooks.wrap_generate)
    if history is None and uses_history(cfg):
        history = HistoryStore(cfg.spec.history_depth)
    drafter = Drafter(cfg.spec, history) if cfg.spec.enabled else None
    if drafter is not None and len(history):
        drafter.rebuild(history.prompt_ids())
    return RolloutParts(engines, shardings, scheduler, history, drafter, rollout_dtype(cfg), merge)


def attach_pass_cost(cfg: RunConfig, rollout: RolloutParts, state: nnx.State) -> None:
    """With ``spec.window=goodput``, give every engine the pass-cost model its draft allocation
    uses: ``spec.step_cost`` when set, else the cached profile of this model and backend (the
    first engine profiles it once, a few seconds; the workers' engines are alike and share it).

    Raises:
      PassCostError: the ``spec.step_cost`` file (or a cached one) cannot be read.
    """
    if not (cfg.spec.enabled and cfg.spec.window == "goodput"):
        return
    first = rollout.engines[0]
    cost = first.use_pass_cost(rollout.states(state)[0], SamplingParams.from_section(cfg.rollout), cfg.spec.step_cost)
    for eng in rollout.engines[1:]:
        eng.pass_cost = cost


def build_pipeline(cfg: RunConfig, policy: Policy, rollout: RolloutParts,
                   callbacks: Sequence[TrainerCallback] = ()) -> RolloutPipeline:
    """The rollout pipeline of a GRPO run (the strategy of ``sched.pipeline`` / ``sched.cross_step``:
    ``pipeline.make_pipeline``): the step's prompts (``prompts.prompt_schedule``), their tokens,
    the weight sync, history and drafter; every step's rollout starts through the ``wrap_submit``
    of ``callbacks``.

    Raises:
      TypeError: a callback is not a ``TrainerCallback``; ValueError: from a ``wrap_submit``.
    """
    hooks = callbacks if isinstance(callbacks, CallbackList) else CallbackList(callbacks)
    g = cfg.grpo
    n_prompts = num_grpo_prompts(cfg, len(policy.train_problems))
    return make_pipeline(cfg, rollout.scheduler,
                         lambda s: prompt_schedule(cfg.run.seed, n_prompts, s, g.prompts_per_step),
                         policy.prompt_tokens, rollout.states, history=rollout.history, drafter=rollout.drafter,
                         submit=hooks.wrap_submit(rollout.scheduler.submit, rollout.scheduler))


# ---------------------------------------------------------------------------------- learner
@dataclass
class Learner:
    """The training side of a run.

    Attributes:
      optimizer: the optax transformation (``grpo`` section).
      layout: shardings of the jitted train programs (params, optimizer state, batch).
      step_fn: ``(state, opt_state, batch) -> (state, opt_state, metrics)`` (``make_grpo_step``;
        with ``grpo.pack_lengths`` ``batch`` is a list of packed calls, ``accumulate.make_accumulating_step``).
      ref_logprob_fn: ``(state, batch) -> f32[B, T-1]`` logprobs under given params: the KL
        reference's, and with ``grpo.tis`` the old policy's recompute (``trainer._truncated_is``).
      ref_state: the frozen KL reference (the starting policy) or None when ``grpo.kl_coef`` is 0.
    """

    optimizer: optax.GradientTransformation
    layout: TrainShardings
    step_fn: Callable
    ref_logprob_fn: Callable
    ref_state: Any = None


def build_learner(cfg: RunConfig, policy: Policy, state: nnx.State,
                  lora: Optional[LoRAParts] = None) -> tuple[Learner, Any]:
    """The update step and the KL reference (a copy of ``state``, the starting params) of a run,
    and the initial optimizer state, created directly in its shardings on the policy's mesh.

    ``state`` holds the float32 master weights (``build_policy``); the AdamW moments follow their
    dtype and the update adds in float32 while the model computes in ``model.dtype``. The
    schedule counts optimizer steps (``grpo.steps x grpo.minibatches``; ``optim.grpo_optimizer``).
    With ``lora`` (``lora_state.build_lora``) ``state`` is the adapters: the optimizer holds them
    only, and the update and KL reference are ``lora_state.lora_learner``'s.
    Returns ``(learner, opt_state)``."""
    g, mesh = cfg.grpo, policy.mesh
    param_sh = param_shardings(state, mesh)
    optimizer = grpo_optimizer(g)
    opt_sh = opt_state_shardings(optimizer, jax.eval_shape(optimizer.init, state), param_sh, mesh)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(state)
    layout = TrainShardings(mesh, param_sh, opt_sh, batch_sharding(mesh))
    if lora is not None:
        return Learner(optimizer, layout, *lora_learner(cfg, policy.graphdef, lora, optimizer, layout)), opt_state
    ref_state = jax.tree.map(jnp.copy, state) if g.kl_coef > 0 else None
    step_fn = update_step_maker(g.pack_lengths)(policy.graphdef, optimizer, eps_low=g.eps_low, eps_high=g.eps_high,
                             kl_coef=g.kl_coef, loss_agg=g.loss_agg, temperature=cfg.rollout.temperature,
                             shardings=layout, memory=UpdateMemory(g.micro_batch_tokens, g.logit_chunk, g.remat),
                             **loss_options(g))
    ref_logprob_fn = make_logprob_fn(policy.graphdef, cfg.rollout.temperature, layout, logit_chunk=g.logit_chunk)
    return Learner(optimizer, layout, step_fn, ref_logprob_fn, ref_state), opt_state


# ---------------------------------------------------------------------------------- the run
@dataclass
class RunStart:
    """Where a run starts: the last finished step and the counters restored with it (all zero /
    None for a fresh run)."""

    step: int = 0
    nonfinite_total: int = 0
    nonfinite_run: int = 0
    eval_before: Optional[dict] = None
    blobs: dict = field(default_factory=dict)


@dataclass
class Run:
    """Every part of a GRPO run (``build_run``).

    Attributes:
      primary: this process writes the run's files (process 0).
      state, opt_state: the params and optimizer state to train from (restored on resume),
        committed to the learner's shardings.
      start: the step and counters to continue from.
    """

    cfg: RunConfig
    run_dir: Path
    primary: bool
    policy: Policy
    learner: Learner
    rollout: RolloutParts
    pipeline: RolloutPipeline
    checkpointer: ckpt.Checkpointer
    state: Any
    opt_state: Any
    start: RunStart


def _restore(checkpointer: ckpt.Checkpointer, state: Any, opt_state: Any, resume: bool) -> tuple[Any, Any, RunStart]:
    """The newest checkpoint restored into this run's shardings (whatever mesh it was written on),
    or the given state when not resuming or there is none."""
    if not resume or checkpointer.latest_step() is None:
        return state, opt_state, RunStart()
    state, opt_state, meta = checkpointer.restore(None, params_like=state, opt_state_like=opt_state)
    step = int(meta["step"])
    start = RunStart(step, int(meta.get("nonfinite_total", 0)), int(meta.get("nonfinite_run", 0)),
                     meta.get("eval_before"), checkpointer.restore_blobs(step))
    return state, opt_state, start


def _write_config(cfg: RunConfig, run_dir: Path) -> None:
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg))))


def build_run(cfg: RunConfig, *, resume: bool = False, callbacks: Sequence[TrainerCallback] = ()) -> Run:
    """Assemble a GRPO run (module docstring): layouts, run directory, policy (warm start),
    learner, checkpoint (restored when ``resume``), rollout parts (with the ``wrap_generate`` of
    ``callbacks``) and pipeline.

    Raises:
      ConfigError: a machine check of ``preflight.prepare`` fails.
      MeshConfigError: a mesh or the batch layout does not fit the devices (before anything is
        written).
      FileNotFoundError: ``run.init_from`` names a missing path.
      ValueError: a checkpoint's history or carried groups are unreadable.
      TypeError: a callback is not a ``TrainerCallback``.
    """
    prepare(cfg)  # the machine checks, before anything is touched
    distributed.initialize(cfg.parallel)  # no-op unless multi-host is configured
    primary = jax.process_index() == 0  # only process 0 writes files (Orbax: all save)
    p = cfg.parallel
    mesh = train_mesh(p.data, p.fsdp, p.tensor)
    check_batch_layout(cfg, mesh)
    meshes = rollout_meshes(p.rollout_tensor, p.rollout_workers)
    run_dir = run_dir_of(cfg)
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    try:  # data, tokenizer, model, warm start, restore: bad input fails in here
        return _assemble(cfg, run_dir, primary, mesh, meshes, resume, callbacks)
    except BaseException:
        if created and primary:  # a fresh run leaves no half-made directory behind
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def _assemble(cfg: RunConfig, run_dir: Path, primary: bool, mesh, meshes, resume: bool,
              callbacks: Sequence[TrainerCallback]) -> Run:
    """``build_run`` after the layout checks: every part, config.yaml once the policy and its warm
    start have loaded."""
    policy, state = build_policy(cfg, run_dir, mesh)
    state = load_warm_start(cfg, run_dir, state)
    lora, state = build_lora(cfg, policy.model_cfg, state, mesh)  # lora.rank > 0: state = the adapters
    if primary:
        _write_config(cfg, run_dir)
    learner, opt_state = build_learner(cfg, policy, state, lora)
    checkpointer = ckpt.Checkpointer(run_dir / "checkpoints", keep=cfg.run.keep_checkpoints)
    state, opt_state, start = _restore(checkpointer, state, opt_state, resume)
    source = f"checkpoint step {start.step}"
    history = (HistoryStore.from_bytes(start.blobs["history"], source=source)
               if uses_history(cfg) and "history" in start.blobs else None)
    rollout = build_rollout(cfg, policy, state if lora is None else lora.base, meshes=meshes, history=history,
                            callbacks=callbacks, merge=None if lora is None else lora.merge)
    attach_pass_cost(cfg, rollout, state)
    pipeline = build_pipeline(cfg, policy, rollout, callbacks)
    if "carry" in start.blobs:  # one_step_off groups waiting for their deferred samples
        pipeline.carry = carry.from_bytes(start.blobs["carry"], source=source)
    # Commit every array to its sharding: restored and freshly built arrays then look the same
    # to jit, so the update compiles once.
    state, opt_state = reshard((state, opt_state), (learner.layout.params, learner.layout.opt_state))
    return Run(cfg, run_dir, primary, policy, learner, rollout, pipeline, checkpointer, state, opt_state, start)
