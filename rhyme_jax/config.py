"""Run configuration: dataclasses merged from YAML files and dotted CLI overrides.

The schema is a tree of dataclasses; OmegaConf validates types and rejects unknown keys, so a
typo in a YAML file or in ``--set a.b=c`` fails with an error naming the key. ``load_config``
returns a read-only OmegaConf object whose attribute access mirrors the dataclasses below.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names the file and key."""


@dataclass
class TinyModelConfig:
    """Shape of a freshly initialised demo model (used when ``model.path`` is empty)."""

    family: str = "qwen3"
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 512


@dataclass
class ModelSection:
    """Policy model: a HF checkpoint directory, or a tiny model initialised from ``tiny``."""

    path: str = ""  # directory with config.json + *.safetensors (+ tokenizer.json), or a known model name
    #               (rhyme-jax models list: imported offline into the user's cache on first use); "" = tiny demo model
    tokenizer_path: str = ""  # tokenizer.json; "" = <path>/tokenizer.json or the demo tokenizer
    dtype: str = "float32"  # compute/param dtype: float32 | bfloat16
    scan_unroll: int = 1  # decoder blocks per lax.scan iteration: 1 = compile cost independent of depth; >= layers = unrolled
    prompt_template: str = "{question}\n"  # formats a problem into the prompt text
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class DataSection:
    """Training / evaluation problems."""

    source: str = "synthetic"  # synthetic | gsm8k
    answer_extraction: str = "marker"  # marker (#### / \\boxed) | last_number (marker, else the last number)
    train_path: str = ""  # gsm8k: path to train.jsonl
    test_path: str = ""  # gsm8k: path to test.jsonl
    seed: int = 0
    num_train: int = 20000  # synthetic: problems in the train split
    num_eval: int = 300  # held-out problems evaluated before/after RL
    min_steps: int = 2  # synthetic: arithmetic steps per problem
    max_steps: int = 4
    max_number: int = 20  # synthetic: operands drawn from [1, max_number]
    tokenizer_vocab_size: int = 256  # demo tokenizer (trained on the task corpus)


@dataclass
class RolloutSection:
    """Rollout engine: paged KV pool, continuous batching and sampling."""

    max_slots: int = 64  # concurrent sequences (continuous-batching slots)
    page_size: int = 16  # tokens per KV page
    num_pages: int = 0  # KV pages in the pool; 0 = enough for max_slots full-length sequences
    max_prompt_len: int = 128  # tokens
    max_new_tokens: int = 96
    prefill_chunk: int = 0  # reserved for chunked prefill; 0 = whole prompts
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    on_overlong_prompt: str = "error"  # error | skip
    attention_impl: str = "auto"  # auto | reference | pallas_tpu | pallas_gpu | *_interpret | "a,b" (tried in order)
    max_verify_tokens: int = 0  # packed tokens per decode/verify step (drafts included); 0 = 4 x max_slots
    share_prompt_prefix: bool = True  # samples of one prompt share its full KV pages (prefill once)


@dataclass
class SFTSection:
    """Supervised warm start on worked solutions."""

    steps: int = 300
    batch_size: int = 32
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    schedule: str = "constant"  # constant | cosine (after linear warmup)
    weight_decay: float = 0.0


@dataclass
class GRPOSection:
    """GRPO family objective (ARCHITECTURE.md section 7)."""

    steps: int = 40
    prompts_per_step: int = 16
    samples_per_prompt: int = 8  # group size n
    num_prompts: int = 0  # train problems GRPO cycles over (epochs of this set); 0 = all
    eps_low: float = 0.2
    eps_high: float = 0.28  # DAPO clip-higher
    kl_coef: float = 0.0  # k3 KL to the frozen reference; 0 = off (no reference kept)
    scale_by_std: bool = True  # False = Dr.GRPO advantages (r - mean)
    loss_agg: str = "token_mean"  # token_mean | seq_mean_token_mean
    minibatches: int = 1  # optimizer steps per GRPO step (PPO minibatches)
    micro_batch_tokens: int = 0  # gradient micro-batch per device, rows x tokens; 0 = whole minibatch
    logit_chunk: int = 0  # tokens whose [tokens, vocab] logits exist at once; 0 = unchunked
    remat: bool = False  # recompute each decoder block in the backward pass
    learning_rate: float = 1e-3
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine (after linear warmup)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    max_consecutive_nonfinite: int = 3


@dataclass
class RunSection:
    """Where and how a run writes its outputs."""

    name: str = "demo"
    runs_dir: str = "runs"
    seed: int = 0
    checkpoint_every: int = 10  # steps
    keep_checkpoints: int = 2
    eval_every: int = 0  # steps; 0 = only before and after
    eval_samples: int = 0  # >0: also mean@k held-out accuracy with k samples at rollout.temperature
    progress: bool = True
    init_from: str = ""  # params to start GRPO from: <run>/sft, <run>/checkpoints/<step> or a params dir
    # persistent XLA cache: "" = <user cache>/compile_cache, a directory, or "off"
    # (env RHYME_JAX_COMPILE_CACHE overrides; rhyme_jax/compile_cache.py)
    compile_cache: str = ""


@dataclass
class SpecSection:
    """HistoSpec switches (ARCHITECTURE.md section 5; paper defaults, specRL variants as options)."""

    enabled: bool = False  # draft from the previous rollout of each prompt (epoch 2 on)
    branch: str = "reward"  # branch choice in the suffix index: reward (paper) | count (specRL)
    window: str = "aimd"  # draft window: aimd (2, +2, reset 2, cap 32) | mimd (2, x2, /2, cap 16) | fixed
    fixed_window: int = 8  # draft length of window=fixed
    min_token_prob: float = 0.1  # stop drafting when the branch probability falls below (0 = off)
    pattern_max: int = 7  # longest suffix of the running sequence matched in the index
    pattern_min: int = 3  # shortest match accepted (back-off floor)
    history_depth: int = 1  # rollouts of each prompt kept in the history store
    self_lookup: bool = False  # extension: no history match -> draft from the sequence's own earlier tokens


@dataclass
class ParallelSection:
    """Device meshes and multi-host start-up (ARCHITECTURE.md section 9; rhyme_jax/parallel/)."""

    data: int = 1  # train mesh: data-parallel replicas (-1 = the devices left)
    fsdp: int = 1  # train mesh: parameter/optimizer sharding over the hidden dimension
    tensor: int = 1  # train mesh: tensor parallelism over heads / MLP features / vocabulary
    rollout_tensor: int = 1  # devices per rollout worker (tensor parallel over heads, KV pool by KV head)
    rollout_workers: int = 1  # data-parallel rollout workers per process; 0 = local devices / rollout_tensor
    distributed: bool = False  # multi-host: jax.distributed.initialize (auto-detect unless the fields below are set)
    coordinator_address: str = ""  # host:port of process 0; "" = $RHYME_COORDINATOR_ADDRESS
    num_processes: int = 0  # 0 = $RHYME_NUM_PROCESSES
    process_id: int = -1  # -1 = $RHYME_PROCESS_ID


@dataclass
class SchedSection:
    """Rollout scheduling over the rollout workers (ARCHITECTURE.md section 6; rhyme_jax/sched/)."""

    mode: str = "fifo"  # fifo (groups split over workers in order) | histopipe
    pipeline: str = "sync"  # sync (on-policy) | one_step_off (rollout s+1 overlaps update s; staleness 1)
    cross_step: bool = False  # one_step_off: per-worker queues, a worker starts step s+1 when its part of s is done
    tier1: bool = True  # histopipe: ranking groups by predicted length, odd steps ascending / even descending
    tier2: bool = True  # histopipe: more workers for long groups (binary search on the makespan)
    migration: bool = True  # histopipe: tails longer than growth x predicted move to an idle worker
    num_groups: int = 0  # ranking groups; 0 = max(1, workers // 2)
    length_stat: str = "mean"  # length prediction from the last rollout: mean | max | p90
    growth: float = 1.5  # migration: generated > growth x predicted length
    tail_fraction: float = 0.1  # migration: the worker has at most this share of its rows unfinished
    cost_model: str = ""  # profiled cost model JSON (benchmarks/schedule.py --mode profile); "" = placeholder


@dataclass
class RunConfig:
    """Top-level run configuration (configs/*.yaml)."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    sft: SFTSection = field(default_factory=SFTSection)
    grpo: GRPOSection = field(default_factory=GRPOSection)
    run: RunSection = field(default_factory=RunSection)
    spec: SpecSection = field(default_factory=SpecSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    sched: SchedSection = field(default_factory=SchedSection)


def load_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None) -> Any:
    """Build the run configuration from defaults, a YAML file and dotted overrides.

    Args:
      path: YAML file whose keys follow ``RunConfig``; a top-level ``defaults: [other.yaml]``
        list loads those files first (paths relative to this file).
      overrides: ``["grpo.steps=10", "run.name=x"]`` style strings, applied last.

    Returns:
      A read-only OmegaConf ``DictConfig`` typed by ``RunConfig``.

    Raises:
      ConfigError: the file is missing or not valid YAML, a key is unknown, or a value has the
        wrong type; the message names the file (or ``--set``) and the key.
    """
    cfg = OmegaConf.structured(RunConfig)
    if path is not None:
        cfg = _merge_file(cfg, Path(path), seen=())
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. grpo.steps=10")
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as exc:
            raise ConfigError(f"--set {item!r}: {_first_line(exc)}") from None
    source = str(path) if path is not None else "--set"
    _resolve_model_name(cfg)
    validate(cfg, source + (" with --set overrides" if path is not None and overrides else ""))
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _resolve_model_name(cfg: DictConfig) -> None:
    """``model.path`` naming a known offline model (``rhyme_jax.model.hub.MODELS``) and not an
    existing directory becomes that model's cache directory (imported on first use by ``hub.ensure``)."""
    from rhyme_jax.model import hub

    name = cfg.model.path
    if name in hub.MODELS and not Path(name).is_dir():
        cfg.model.path = str(hub.model_dir(name))


_CHOICES = {
    "model.dtype": ("float32", "bfloat16"),
    "data.source": ("synthetic", "gsm8k"),
    "data.answer_extraction": ("marker", "last_number"),
    "rollout.on_overlong_prompt": ("error", "skip"),
    "sft.schedule": ("constant", "cosine"),
    "grpo.schedule": ("constant", "cosine"),
    "grpo.loss_agg": ("token_mean", "seq_mean_token_mean"),
    "spec.branch": ("reward", "count"),
    "spec.window": ("aimd", "mimd", "fixed"),
    "sched.mode": ("fifo", "histopipe"),
    "sched.pipeline": ("sync", "one_step_off"),
    "sched.length_stat": ("mean", "max", "p90"),
}


def validate(cfg: Any, source: str) -> None:
    """Check enumerations and cross-field ranges that types alone cannot express.

    Raises:
      ConfigError: naming ``source`` (the file or ``--set``) and the offending field.
    """
    for key, allowed in _CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{source}: {key}={value!r} must be one of {list(allowed)}")
    positive = ["model.scan_unroll", "rollout.max_slots", "rollout.page_size", "rollout.max_prompt_len",
                "rollout.max_new_tokens", "sft.batch_size", "grpo.prompts_per_step",
                "grpo.samples_per_prompt", "grpo.minibatches", "run.checkpoint_every",
                "run.keep_checkpoints", "data.num_eval"]
    for key in positive:
        if OmegaConf.select(cfg, key) < 1:
            raise ConfigError(f"{source}: {key} must be >= 1, got {OmegaConf.select(cfg, key)}")
    for section in ("sft", "grpo"):
        steps, warm = cfg[section].steps, cfg[section].warmup_steps
        if warm < 0 or (steps > 0 and warm > steps):
            raise ConfigError(f"{source}: {section}.warmup_steps={warm} must be in [0, {section}.steps={steps}]")
    batch = cfg.grpo.prompts_per_step * cfg.grpo.samples_per_prompt
    if cfg.grpo.minibatches > batch:
        raise ConfigError(f"{source}: grpo.minibatches={cfg.grpo.minibatches} exceeds the rollout batch "
                          f"grpo.prompts_per_step * grpo.samples_per_prompt = {batch}")
    for key in ("grpo.micro_batch_tokens", "grpo.logit_chunk"):
        if OmegaConf.select(cfg, key) < 0:
            raise ConfigError(f"{source}: {key} must be >= 0 (0 = off), got {OmegaConf.select(cfg, key)}")
    if cfg.grpo.num_prompts < 0 or cfg.rollout.max_verify_tokens < 0:
        raise ConfigError(f"{source}: grpo.num_prompts and rollout.max_verify_tokens must be >= 0 (0 = default)")
    _validate_parallel(cfg, source)
    _validate_compile_cache(cfg, source)
    from rhyme_jax.parallel import distributed

    # Fail at load, not after SFT: the name must exist and run on this backend. A multi-host run
    # must not touch the backend before jax.distributed.initialize; its engine checks instead.
    if distributed.settings(cfg.parallel) is None:
        try:
            from pallas_kernels.ragged_paged_attention import api as attention_api

            attention_api.resolve_name(attention_api.parse_implementation(cfg.rollout.attention_impl))
        except ValueError as exc:
            raise ConfigError(f"{source}: rollout.attention_impl: {exc}") from None
    sp = cfg.spec
    if not 1 <= sp.pattern_min <= sp.pattern_max:
        raise ConfigError(f"{source}: spec.pattern_min={sp.pattern_min} and spec.pattern_max={sp.pattern_max} "
                          f"need 1 <= pattern_min <= pattern_max")
    if not 0.0 <= sp.min_token_prob < 1.0:
        raise ConfigError(f"{source}: spec.min_token_prob={sp.min_token_prob} must be in [0, 1)")
    if sp.history_depth < 1 or not 1 <= sp.fixed_window <= 32:
        raise ConfigError(f"{source}: spec.history_depth >= 1 and 1 <= spec.fixed_window <= 32 are required")
    if cfg.rollout.temperature < 0 or not 0 < cfg.rollout.top_p <= 1 or cfg.rollout.top_k < 0:
        raise ConfigError(f"{source}: rollout.temperature >= 0, 0 < rollout.top_p <= 1 and "
                          f"rollout.top_k >= 0 are required")


def _validate_compile_cache(cfg: Any, source: str) -> None:
    value = str(cfg.run.compile_cache or "").strip()
    if value and value.lower() != "off" and Path(value).expanduser().exists() \
            and not Path(value).expanduser().is_dir():
        raise ConfigError(f"{source}: run.compile_cache={value!r} is a file; give a directory, "
                          f"'' (the user's cache) or 'off'")


def _validate_parallel(cfg: Any, source: str) -> None:
    from rhyme_jax.parallel import distributed

    p = cfg.parallel
    for key in ("data", "fsdp", "tensor"):
        if p[key] == 0 or p[key] < -1:
            raise ConfigError(f"{source}: parallel.{key}={p[key]} must be >= 1 or -1 (the devices left)")
    sc = cfg.sched
    if sc.num_groups < 0 or sc.growth <= 0 or not 0 < sc.tail_fraction <= 1:
        raise ConfigError(f"{source}: sched.num_groups >= 0, sched.growth > 0 and 0 < sched.tail_fraction <= 1 "
                          f"are required")
    if sc.cross_step and sc.pipeline != "one_step_off":
        raise ConfigError(f"{source}: sched.cross_step=true needs sched.pipeline=one_step_off "
                          f"(got sched.pipeline={sc.pipeline!r})")
    if p.rollout_tensor < 1 or p.rollout_workers < 0:
        raise ConfigError(f"{source}: parallel.rollout_tensor >= 1 and parallel.rollout_workers >= 0 "
                          f"are required")
    try:
        distributed.settings(p)
    except distributed.DistributedConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _merge_file(cfg: DictConfig, path: Path, seen: tuple) -> DictConfig:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path.resolve() in seen:
        raise ConfigError(f"{path}: circular 'defaults' include")
    try:
        raw = OmegaConf.load(path)
    except Exception as exc:  # yaml.YAMLError and friends carry line numbers in their text
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"{path}: top level must be a mapping")
    includes = raw.pop("defaults", [])
    for inc in includes:
        cfg = _merge_file(cfg, path.parent / str(inc), seen + (path.resolve(),))
    try:
        return OmegaConf.merge(cfg, raw)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{path}: {_first_line(exc)}") from None


def _first_line(exc: Exception) -> str:
    """OmegaConf's message in one line: the problem and the full key, without type noise."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), "")
    return lines[0] + (f" (key: {key})" if key else "")


def to_dict(cfg: Any) -> dict:
    """Plain nested dict of a config (for saving next to a run)."""
    return OmegaConf.to_container(cfg, resolve=True)


def schema_fields() -> list[str]:
    """Dotted names of every configurable field (for docs and error hints)."""
    out = []

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(default):
                walk(type(default), prefix + f.name + ".")
            else:
                out.append(prefix + f.name)

    walk(RunConfig, "")
    return out
