"""The sections of a run configuration: frozen dataclasses that check their own values.

Each section's ``__post_init__`` checks what the section alone determines (ranges, choices,
relations between its fields); ``RunConfig`` (``run_config.py``) checks across sections. The
allowed values of a choice field are its ``Literal[...]`` annotation (``checks.check_fields``
reads it). ``KEY`` is the section's dotted name in the YAML files and in error messages.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from rhyme_jax.config.checks import ConfigError, above, at_least, check_fields, fail

Family = Literal["qwen2", "qwen3", "llama"]
Dtype = Literal["float32", "bfloat16"]
RolloutDtype = Literal["", "float32", "bfloat16"]
DataSource = Literal["synthetic", "ledger", "gsm8k", "jsonl", "parquet"]
AnswerExtraction = Literal["marker", "last_number"]
OverlongPrompt = Literal["error", "skip"]
LayerWeights = Literal["auto", "split", "stacked"]
LRSchedule = Literal["constant", "cosine"]
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "step_token_mean"]
ScaleRewards = Literal["group", "batch", "none"]
ISLevel = Literal["token", "sequence"]
DraftBranch = Literal["reward", "count"]
DraftWindow = Literal["aimd", "mimd", "fixed", "goodput"]
SchedMode = Literal["fifo", "histopipe"]
SchedPipeline = Literal["sync", "one_step_off"]
LengthStat = Literal["mean", "max", "p90"]
SchedPlacement = Literal["tiers", "exact", "spread"]
REPORT_SINKS = ("tensorboard", "wandb")  # run.report_to

MAX_DRAFT = 32  # longest draft of one row in one step: the single source (rollout.shapes, spec.window, spec.drafter)
MAX_PATTERN = 256  # longest matched suffix: the drafter's self-lookup context (spec/drafter.py)
SEED_LIMIT = 2 ** 32  # jax.random.key keeps 32 bits of a seed without x64


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of a freshly initialised demo model (used when ``model.path`` is empty)."""

    KEY: ClassVar[str] = "model.tiny"

    family: Family = "qwen3"  # architecture family (rhyme_jax/model/config.py)
    hidden_size: int = 128  # residual stream width
    intermediate_size: int = 384  # MLP hidden width
    num_layers: int = 4  # decoder blocks
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention)
    head_dim: int = 32  # width of one attention head
    rope_theta: float = 10000.0  # RoPE base frequency
    tie_word_embeddings: bool = True  # output head shares the embedding matrix
    max_position_embeddings: int = 512  # longest supported position (informational)

    def __post_init__(self):
        check_fields(self)
        at_least(self, 1, "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "max_position_embeddings")
        if self.num_heads % self.num_kv_heads:
            raise fail(self, "num_kv_heads", f"must divide model.tiny.num_heads={self.num_heads}")
        above(self, 0.0, "rope_theta")


@dataclass(frozen=True)
class ModelSection:
    """Policy model: a HF checkpoint directory, or a tiny model initialised from ``tiny``."""

    KEY: ClassVar[str] = "model"

    path: str = ""  # directory with config.json + *.safetensors (+ tokenizer.json), or a known model name
    #               (rhyme-jax models list: imported offline into the user's cache on first use); "" = tiny demo model
    tokenizer_path: str = ""  # tokenizer.json; "" = <path>/tokenizer.json or the demo tokenizer
    dtype: Dtype = "float32"  # compute dtype; parameters and AdamW moments stay float32 (master weights)
    scan_unroll: int = 1  # decoder blocks per lax.scan iteration: 1 = compile cost independent of depth; >= layers = unrolled
    attention_block: int = 0  # training/scoring buffers longer than this many tokens use block-sparse attention over their segments (O(T * block) memory, blocks outside any segment skipped); 0 = dense
    prompt_template: str = "{question}\n"  # formats a problem into the prompt text
    # none: prompt_template | auto: the tokenizer's chat template, else prompt_template | tokenizer: the tokenizer's
    # (required) | a .jinja file; renders [system_prompt,] question as a user turn + generation prompt (docs/chat_template.md)
    chat_template: str = "none"
    system_prompt: str = ""  # with a chat template: a system turn before the question; "" = none (the template's default)
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)

    def decoder_options(self) -> dict:
        """The ``Decoder``'s plain attributes this section sets: ``scan_unroll`` and
        ``attention_block`` (constructor keywords, or attributes to set after loading)."""
        return {"scan_unroll": self.scan_unroll, "attention_block": self.attention_block}

    def __post_init__(self):
        check_fields(self)
        at_least(self, 1, "scan_unroll")
        if self.attention_block < 0 or self.attention_block % 16:
            raise fail(self, "attention_block", "must be 0 (dense) or a positive multiple of 16")
        if self.chat_template not in ("none", "auto", "tokenizer") and not Path(self.chat_template).is_file():
            raise fail(self, "chat_template", "must be none, auto, tokenizer or an existing jinja file")
        if self.system_prompt and self.chat_template == "none":
            raise fail(self, "system_prompt", "needs a model.chat_template (put the instructions in model.prompt_template)")
        try:
            self.prompt_template.format(question="")
        except (KeyError, IndexError, ValueError) as exc:
            raise fail(self, "prompt_template", f"may only use the field {{question}} ({exc!r}); "
                                                f"write a literal brace as {{{{ or }}}}") from None


@dataclass(frozen=True)
class DataSection:
    """Training / evaluation problems."""

    KEY: ClassVar[str] = "data"

    source: DataSource = "synthetic"  # synthetic | ledger (long-tailed worked solutions) | gsm8k | jsonl / parquet: your own files (docs/custom_data.md)
    answer_extraction: AnswerExtraction = "marker"  # marker (#### / \\boxed) | last_number (marker, else the last number)
    train_path: str = ""  # gsm8k: path to train.jsonl ("" = vendored); jsonl / parquet: the train file (required)
    test_path: str = ""  # gsm8k: path to test.jsonl ("" = vendored); jsonl / parquet: the held-out file (required)
    prompt_field: str = "question"  # jsonl / parquet: the record field holding the prompt text
    answer_field: str = "answer"  # jsonl / parquet: the gold answer, "<reasoning> #### 42" or a plain "42"
    # jsonl / parquet: record fields copied into Problem.metadata (the reward function sees them)
    metadata_fields: list[str] = field(default_factory=list, hash=False)
    seed: int = 0  # synthetic: seed of the generated train / eval problems
    num_train: int = 20000  # synthetic: problems in the train split
    num_eval: int = 300  # held-out problems evaluated before/after RL
    min_steps: int = 2  # synthetic: arithmetic steps per problem; ledger: the entry count's scale (fewest entries)
    max_steps: int = 4  # synthetic: most arithmetic steps per problem; ledger: the cap on entries
    tail_index: float = 1.1  # ledger: Pareto index of the entry count (smaller = longer tail)
    max_number: int = 20  # synthetic: operands drawn from [1, max_number]
    tokenizer_vocab_size: int = 256  # demo tokenizer (trained on the task corpus)

    def __post_init__(self):
        check_fields(self)
        at_least(self, 1, "num_train", "num_eval", "min_steps", "tokenizer_vocab_size")
        at_least(self, self.min_steps, "max_steps", note=" (data.min_steps)")
        at_least(self, 2, "max_number")
        above(self, 0, "tail_index")
        if self.source in ("jsonl", "parquet"):
            for name in ("train_path", "test_path"):
                if not getattr(self, name).strip():
                    raise fail(self, name, f"must name a {self.source} file for data.source={self.source!r}")
        for name in ("prompt_field", "answer_field"):
            if not getattr(self, name).strip():
                raise fail(self, name, "must name a record field")
        if any(not isinstance(f, str) or not f.strip() for f in self.metadata_fields):
            raise fail(self, "metadata_fields", "must be a list of record field names")


_REWARD_SPEC = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


@dataclass(frozen=True)
class RewardTerm:
    """One entry of ``reward.fns`` (checked by ``RewardSection``): a reward function and its weight."""

    KEY: ClassVar[str] = "reward.fns[]"  # for OmegaConf's errors about an entry (config/loader.py)

    fn: str = ""  # "package.module:function", the contract of reward.fn
    weight: float = 1.0  # its weight in the sum (TRL reward_weights)
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False)  # keyword arguments of every call
    batched: bool = False  # as reward.batched


@dataclass(frozen=True)
class RewardSection:
    """The GRPO reward: the built-in verifier of ``data.answer_extraction``, or your own function
    (docs/custom_reward.md). The function is imported and its signature checked before any work
    (``rhyme_jax.data.custom_reward``), not here: where modules are found depends on the machine."""

    KEY: ClassVar[str] = "reward"

    # "package.module:function", imported from the working directory, PYTHONPATH or the installed
    # packages; "" = the built-in reward of data.answer_extraction
    fn: str = ""
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False)  # keyword arguments of every call of fn
    batched: bool = False  # false: fn(response, problem, **kwargs) -> float; true: fn(responses, problems, **kwargs) -> floats
    # several functions, reward = sum of weight x fn (TRL reward_funcs + reward_weights): a list of
    # {fn, weight, kwargs, batched}; instead of reward.fn; [] = off
    fns: list[RewardTerm] = field(default_factory=list, hash=False)
    # DAPO soft overlong punishment (eq. 13; TRL soft_punish_cache, verl overlong_buffer.len): a response over
    # rollout.max_new_tokens - this many tokens gets a penalty falling linearly to -soft_overlong_factor; 0 = off
    soft_overlong_cache: int = 0
    soft_overlong_factor: float = 1.0  # the penalty at rollout.max_new_tokens tokens (DAPO, TRL: 1; verl penalty_factor)

    def __post_init__(self):
        check_fields(self)
        at_least(self, 0, "soft_overlong_cache", note=" (0 = off)")
        above(self, 0.0, "soft_overlong_factor")
        if self.fn and not _REWARD_SPEC.fullmatch(self.fn):
            raise fail(self, "fn", "must be 'package.module:function' (e.g. 'my_reward:reward'; '' = built-in)")
        if not self.fn and (self.kwargs or self.batched):
            name = "kwargs" if self.kwargs else "batched"
            raise fail(self, name, "needs reward.fn (the built-in reward takes no options)")
        if self.fns and self.fn:
            raise fail(self, "fn", "and reward.fns are both set: use one (reward.fns takes a list of functions)")
        for i, term in enumerate(self.fns):
            _check_term(i, term)
        names = [term_name(t.fn) for t in self.fns]
        if len(set(names)) < len(names):
            raise ConfigError(f"reward.fns names a function twice ({names}): merge them, or weight it once")


def term_name(spec: str) -> str:
    """The metrics name of a ``reward.fns`` entry: its function's name (``pkg.mod:a.b`` -> ``b``)."""
    return spec.rpartition(":")[2].rpartition(".")[2]


def _check_term(i: int, term: RewardTerm) -> None:
    """``reward.fns[i]``: a ``package.module:function`` spec and a finite weight.

    Raises:
      ConfigError: naming ``reward.fns[i].<field>``.
    """
    if not isinstance(term, RewardTerm):
        raise ConfigError(f"reward.fns[{i}]={term!r} must be a mapping {{fn: 'module:function', weight: 1.0}}")
    if not _REWARD_SPEC.fullmatch(term.fn):
        raise ConfigError(f"reward.fns[{i}].fn={term.fn!r} must be 'package.module:function' (e.g. 'my_reward:reward')")
    if not math.isfinite(term.weight):
        raise ConfigError(f"reward.fns[{i}].weight={term.weight!r} must be a finite number")


@dataclass(frozen=True)
class RolloutSection:
    """Rollout engine: paged KV pool, continuous batching and sampling."""

    KEY: ClassVar[str] = "rollout"

    max_slots: int = 64  # concurrent sequences (continuous-batching slots)
    page_size: int = 16  # tokens per KV page
    num_pages: int = 0  # KV pages in the pool; 0 = enough for max_slots full-length sequences
    max_prompt_len: int = 128  # tokens
    max_new_tokens: int = 96  # response budget per sample (tokens)
    temperature: float = 1.0  # > 0: the GRPO loss scores tokens at this temperature
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    on_overlong_prompt: OverlongPrompt = "error"  # prompt over max_prompt_len: error | skip (empty response, reward 0)
    attention_impl: str = "auto"  # auto | reference | pallas_tpu | pallas_gpu | *_interpret | "a,b" (tried in order)
    max_verify_tokens: int = 0  # packed tokens per decode/verify step (drafts included); 0 = 4 x max_slots; 33 x max_slots: room for a whole draft per row (pays at acceptance ~0.9; at ~0.5 it can cost 20%)
    share_prompt_prefix: bool = True  # samples of one prompt share its full KV pages (prefill once)
    passes_per_dispatch: int = 1  # decode passes per device call (rollout/chunk.py): > 1 cuts host time per pass ~N-fold; a row finishing mid-chunk idles to the chunk's end and rows hold pages for N tokens ahead; with HistoSpec the chunk drafts on the device (rollout/chunk_spec.py)
    draft_history: int = 1024  # HistoSpec chunks: history tokens per row the device drafts from (the prompt's last rollouts, its siblings)
    row_buckets: list[int] = field(default_factory=list, hash=False)  # extra decode/verify row buckets beside max_slots/16, /4 and max_slots (rollout/shapes.py seq_buckets): long tails decoding alone or in few rows run small programs; each adds programs to compile
    # engine weights and KV pages: "" = model.dtype | float32 | bfloat16 (a bf16 copy of the float32 master
    # weights, cast at each weight sync; its logprobs differ from the trainer's: grpo.tis corrects; docs/precision.md)
    dtype: RolloutDtype = ""
    layer_weights: LayerWeights = "auto"  # split = the blocks' weights as separate arrays, a layer loop without weight slices (CPU, SmolLM2: 1.13-1.41x decode, 4x compile); stacked = a scan; auto = split on CPU for blocks of at least 4 MiB (rollout/layer_weights.py)

    def __post_init__(self):
        check_fields(self)
        at_least(self, 1, "max_slots", "page_size", "max_prompt_len", "max_new_tokens", "passes_per_dispatch",
                 "draft_history")
        at_least(self, 0, "num_pages", "max_verify_tokens", note=" (0 = default)")
        at_least(self, 0, "top_k", note=" (0 = off)")
        if any(int(b) != b or not 1 <= b <= self.max_slots for b in self.row_buckets):
            raise fail(self, "row_buckets", f"each must be an integer in [1, max_slots={self.max_slots}], "
                                            f"got {list(self.row_buckets)}")
        above(self, 0.0, "temperature", note=" (the GRPO loss scores the rollout's tokens at this "
                                             "temperature; held-out evaluation is greedy anyway)")
        if not 0.0 < self.top_p <= 1.0:
            raise fail(self, "top_p", "must be in (0, 1] (1 = off)")
        seq = self.max_prompt_len + self.max_new_tokens
        pages = -(-seq // self.page_size)
        if self.num_pages and self.num_pages - 1 < pages:
            raise fail(self, "num_pages", f"cannot hold one full-length sequence: max_prompt_len + "
                                          f"max_new_tokens = {seq} tokens need {pages} pages of "
                                          f"{self.page_size} plus scratch page 0 (0 = enough for max_slots)")


def _check_warmup(section) -> None:
    """``0 <= warmup_steps <= steps`` (any warmup when ``steps`` is 0)."""
    if section.warmup_steps < 0 or (section.steps > 0 and section.warmup_steps > section.steps):
        raise fail(section, "warmup_steps", f"must be in [0, {section.KEY}.steps={section.steps}]")


@dataclass(frozen=True)
class SFTSection:
    """Supervised warm start on worked solutions."""

    KEY: ClassVar[str] = "sft"

    steps: int = 300  # 0 = no warm start (`train` and `demo` start GRPO from the initial weights; `sft` refuses)
    batch_size: int = 32  # problems per SFT step
    learning_rate: float = 3e-3  # AdamW peak learning rate
    warmup_steps: int = 20  # steps of linear warmup from 0
    schedule: LRSchedule = "constant"  # after linear warmup
    weight_decay: float = 0.0  # AdamW decoupled weight decay (parameters of rank >= 2)
    max_tokens: int = 0  # warm start only on problems whose prompt + solution fit (tokens); 0 = all (long-tailed tasks: SFT on the short ones, RL on all)
    # pack each batch's problems back to back into buffers of the longest problem's length (segment ids, positions
    # per segment; train/packing.py) instead of one padded row each: long-tailed tasks pay for their real tokens
    padding_free: bool = False

    def __post_init__(self):
        check_fields(self)
        at_least(self, 0, "steps", "weight_decay", "max_tokens")
        at_least(self, 1, "batch_size")
        above(self, 0.0, "learning_rate")
        _check_warmup(self)


def _check_pack_lengths(g: Any) -> None:
    """``grpo.pack_lengths``: increasing multiples of 16, and only with ``grpo.padding_free``."""
    lengths = list(g.pack_lengths)
    if not lengths:
        return
    if not g.padding_free:
        raise fail(g, "pack_lengths", "needs grpo.padding_free=true (the lengths are packed buffers')")
    if any(not isinstance(n, int) or n < 16 or n % 16 for n in lengths):
        raise fail(g, "pack_lengths", "must hold multiples of 16 (tokens per buffer)")
    if any(b <= a for a, b in zip(lengths, lengths[1:])):
        raise fail(g, "pack_lengths", "must be strictly increasing")


def _check_skip_rows(g: Any) -> None:
    """``grpo.skip_zero_advantage_rows``: only in a packed update, and only where such a row has no
    gradient (no KL or entropy term)."""
    if not g.skip_zero_advantage_rows:
        return
    if not g.padding_free:
        raise fail(g, "skip_zero_advantage_rows", "needs grpo.padding_free=true (rows leave the packed buffers)")
    for key in ("kl_coef", "entropy_coef"):
        if getattr(g, key) > 0:
            raise fail(g, "skip_zero_advantage_rows", f"needs grpo.{key}=0: with it a row of advantage 0 still "
                       "carries gradient")


@dataclass(frozen=True)
class GRPOSection:
    """GRPO family objective (``train/losses.py``; the keys against TRL's GRPOConfig: docs/trl_mapping.md)."""

    KEY: ClassVar[str] = "grpo"

    steps: int = 40  # GRPO steps (one rollout and update each)
    prompts_per_step: int = 16  # prompts rolled out per step (x samples_per_prompt rows)
    samples_per_prompt: int = 8  # group size n
    num_prompts: int = 0  # train problems GRPO cycles over (epochs of this set); 0 = all
    eps_low: float = 0.2  # clip range below: ratio >= 1 - eps_low
    eps_high: float = 0.28  # DAPO clip-higher
    kl_coef: float = 0.0  # k3 KL to the frozen reference; 0 = off (no reference kept)
    # weight the k3 term by the policy ratio (unbiased reverse-KL gradient; TRL use_bias_correction_kl,
    # default True there; false = DeepSeekMath's plain k3); needs kl_coef > 0
    kl_ratio_weighted: bool = False
    # importance ratio per token | per sequence: exp(token mean of log-ratio), clipped as one (GSPO; TRL's key)
    importance_sampling_level: ISLevel = "token"
    entropy_coef: float = 0.0  # loss - entropy_coef x token-mean entropy (TRL entropy_coef); 0 = off
    # advantage (r - group mean) / (std + 1e-4), sample std of: group (GRPO) | batch (all the step's rewards)
    # | none: no division (Dr.GRPO)
    scale_rewards: ScaleRewards = "group"
    # token_mean (minibatch tokens; TRL bnpo) | seq_mean_token_mean (mean of row means; TRL grpo) |
    # seq_mean_token_sum_norm (sum / (rows x rollout.max_new_tokens); TRL dr_grpo) |
    # step_token_mean (sum / (the step's tokens / minibatches); TRL dapo). docs/trl_mapping.md
    loss_agg: LossAgg = "token_mean"
    minibatches: int = 1  # optimizer steps per GRPO step (PPO minibatches); divides the rollout batch
    # passes over the minibatches per GRPO step, all against the rollout's behaviour logprobs
    # (TRL num_iterations, PPO epochs): num_iterations x minibatches optimizer steps a step
    num_iterations: int = 1
    micro_batch_tokens: int = 0  # gradient micro-batch per device, rows x tokens; 0 = whole minibatch
    logit_chunk: int = 0  # tokens whose [tokens, vocab] logits exist at once; 0 = unchunked
    remat: bool = False  # recompute each decoder block in the backward pass
    padding_free: bool = False  # pack each minibatch's sequences into full-length rows (segment ids): memory and FLOPs follow real tokens (TRL padding_free)
    # padding_free: buffer lengths to pack into (e.g. [256, 512, ..., 8192]): each row goes into a buffer of the
    # smallest that holds it, so attention follows each row's length, not the longest row's; the gradient is
    # accumulated over calls of micro_batch_tokens (train/length_classes.py). Empty = one length, the longest row's
    pack_lengths: list[int] = field(default_factory=list, hash=False)
    # padding_free: leave rows whose advantage is exactly 0 out of the update's buffers (their loss and gradient
    # terms are 0; the loss weights stay the whole minibatch's). Needs kl_coef = entropy_coef = 0; clip_fraction,
    # ratio_mean, approx_kl then average over the rows that carry gradient (train/packing.py). Rows without loss
    # tokens are always left out
    skip_zero_advantage_rows: bool = False
    learning_rate: float = 1e-3  # AdamW peak learning rate
    warmup_steps: int = 0  # GRPO steps of linear warmup from 0 (x num_iterations x minibatches optimizer steps)
    schedule: LRSchedule = "constant"  # after linear warmup; cosine ends when the run does (steps x num_iterations x minibatches)
    weight_decay: float = 0.0  # AdamW decoupled weight decay (parameters of rank >= 2)
    max_grad_norm: float = 1.0  # <= 0 = no clipping
    max_consecutive_nonfinite: int = 3  # stop after this many steps in a row with a non-finite loss or gradient
    mask_truncated_completions: bool = False  # rows cut at rollout.max_new_tokens (no EOS) carry no loss (TRL's key; DAPO sec. 3.4)
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill with fresh prompts (docs/dynamic_sampling.md)
    refill_rounds: int = 3  # dynamic_sampling: most extra rollouts per step; still short after them, the step trains on what it has
    # truncated importance sampling (TRL vllm_importance_sampling_correction, token_truncate): the trainer recomputes
    # the old logprobs and weights each token's policy-gradient term by min(exp(trainer - sampler), tis_cap)
    tis: bool = False
    tis_cap: float = 2.0  # the weight's cap C (>= 1; Yao et al. 2025 and verl use 2)

    def __post_init__(self):
        check_fields(self)
        at_least(self, 0, "refill_rounds")
        at_least(self, 1, "steps", "prompts_per_step", "samples_per_prompt", "minibatches", "num_iterations",
                 "max_consecutive_nonfinite")
        at_least(self, 0, "num_prompts", note=" (0 = all train problems)")
        at_least(self, 0, "micro_batch_tokens", "logit_chunk", note=" (0 = off)")
        at_least(self, 0, "eps_low", "eps_high", "kl_coef", "entropy_coef", "weight_decay")
        if self.kl_ratio_weighted and self.kl_coef == 0:
            raise fail(self, "kl_ratio_weighted", "needs grpo.kl_coef > 0 (it weights the KL term)")
        above(self, 0.0, "learning_rate")
        at_least(self, 1.0, "tis_cap")
        _check_pack_lengths(self)
        _check_skip_rows(self)
        _check_warmup(self)
        rows = self.prompts_per_step * self.samples_per_prompt
        batch = f"the rollout batch grpo.prompts_per_step * grpo.samples_per_prompt = {rows}"
        if self.minibatches > rows:
            raise fail(self, "minibatches", f"exceeds {batch}")
        if rows % self.minibatches:
            raise fail(self, "minibatches", f"must divide {batch} rows")


@dataclass(frozen=True)
class RunSection:
    """Where and how a run writes its outputs."""

    KEY: ClassVar[str] = "run"

    name: str = "demo"  # the run directory is <runs_dir>/<name>
    runs_dir: str = "runs"  # parent directory of the run directories
    seed: int = 0  # model init, prompt order, sampling keys and SFT data order
    checkpoint_every: int = 10  # steps
    keep_checkpoints: int = 2  # newest checkpoints kept on disk
    eval_every: int = 0  # steps; 0 = only before and after
    eval_samples: int = 0  # >0: also mean@k held-out accuracy with k samples at rollout.temperature
    progress: bool = True  # progress bars on the terminal
    init_from: str = ""  # params to start GRPO from: <run>/sft, <run>/checkpoints/<step> or a params dir
    # persistent XLA cache: "" = <user cache>/compile_cache, a directory, or "off"
    # (env RHYME_JAX_COMPILE_CACHE overrides; rhyme_jax/compile_cache.py)
    compile_cache: str = ""
    # metric sinks beside metrics.jsonl: tensorboard (<run>/tb) and/or wandb (pip install 'rhyme-jax[wandb]'; docs/metrics.md)
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"], hash=False)
    wandb_project: str = ""  # W&B project; "" = $WANDB_PROJECT, else rhyme-jax
    wandb_name: str = ""  # W&B run name; "" = $WANDB_NAME, else run.name (the SFT warm start: <name>-sft)
    wandb_dir: str = ""  # wandb's files go to <wandb_dir>/wandb; "" = $WANDB_DIR, else the run directory

    def __post_init__(self):
        check_fields(self)
        if any(sink not in REPORT_SINKS for sink in self.report_to) or len(set(self.report_to)) < len(self.report_to):
            raise fail(self, "report_to", f"must list distinct sinks out of {list(REPORT_SINKS)} ([] = metrics.jsonl only)")
        if not self.name.strip():
            raise fail(self, "name", "must name the run's directory under run.runs_dir")
        if not 0 <= self.seed < SEED_LIMIT:
            raise fail(self, "seed", "must be in [0, 2**32)")
        at_least(self, 1, "checkpoint_every", "keep_checkpoints")
        at_least(self, 0, "eval_every", "eval_samples", note=" (0 = off)")
        if self.init_from and not Path(self.init_from).exists():
            raise fail(self, "init_from", "does not exist (a params directory, <run>/sft or "
                                          "<run>/checkpoints/<step>)")
        value = self.compile_cache.strip()
        if value and value.lower() != "off" and Path(value).expanduser().exists() \
                and not Path(value).expanduser().is_dir():
            raise fail(self, "compile_cache", "is a file; give a directory, '' (the user's cache) or 'off'")


@dataclass(frozen=True)
class SpecSection:
    """HistoSpec switches (docs/architecture.md, "HistoSpec in one paragraph"; paper defaults, specRL variants as options)."""

    KEY: ClassVar[str] = "spec"

    enabled: bool = False  # draft from the previous rollout of each prompt (epoch 2 on)
    branch: DraftBranch = "reward"  # branch choice in the suffix index: reward (paper) | count (specRL)
    # draft window: aimd (2, +2, reset 2, cap 32) | mimd (2, x2, /2, cap 16) | fixed | goodput (drafts up to
    # 32 with acceptance estimates; the engine sizes each row's draft for expected tokens per second)
    window: DraftWindow = "aimd"
    fixed_window: int = 8  # draft length of window=fixed
    min_token_prob: float = 0.1  # stop drafting when the branch probability falls below (0 = off)
    pattern_max: int = 7  # longest suffix of the running sequence matched in the index
    pattern_min: int = 3  # shortest match accepted (back-off floor)
    history_depth: int = 1  # rollouts of each prompt kept in the history store
    self_lookup: bool = False  # extension: no history match -> draft from the sequence's own earlier tokens
    siblings: bool = False  # extension: also draft from the same step's other responses to the prompt (GRPO group)
    # pass-cost model of window=goodput: a profile JSON | "" = profiled at start-up, cached per model and backend
    # | "prior" = the analytical stand-in (2 x rows + packed tokens; no profiling)
    step_cost: str = ""

    def __post_init__(self):
        check_fields(self)
        if not 1 <= self.fixed_window <= MAX_DRAFT:
            raise fail(self, "fixed_window", f"must be in [1, {MAX_DRAFT}]")
        if not 0.0 <= self.min_token_prob < 1.0:
            raise fail(self, "min_token_prob", "must be in [0, 1) (0 = off)")
        at_least(self, 1, "pattern_min", "history_depth")
        if not self.pattern_min <= self.pattern_max <= MAX_PATTERN:
            raise fail(self, "pattern_max", f"must be in [spec.pattern_min={self.pattern_min}, {MAX_PATTERN}]")
        if self.step_cost not in ("", "prior") and not Path(self.step_cost).is_file():
            raise fail(self, "step_cost", "is not a file (a pass-cost profile JSON; '' = profile at start-up, 'prior' = no profile)")


@dataclass(frozen=True)
class ParallelSection:
    """Device meshes and multi-host start-up (rhyme_jax/parallel/)."""

    KEY: ClassVar[str] = "parallel"

    data: int = 1  # train mesh: data-parallel replicas (-1 = the devices left)
    fsdp: int = 1  # train mesh: parameter/optimizer sharding over the hidden dimension
    tensor: int = 1  # train mesh: tensor parallelism over heads / MLP features / vocabulary
    rollout_tensor: int = 1  # devices per rollout worker (tensor parallel over heads, KV pool by KV head)
    rollout_workers: int = 1  # data-parallel rollout workers per process; 0 = local devices / rollout_tensor
    distributed: bool = False  # multi-host: jax.distributed.initialize (auto-detect unless the fields below are set)
    coordinator_address: str = ""  # host:port of process 0; "" = $RHYME_COORDINATOR_ADDRESS
    num_processes: int = 0  # 0 = $RHYME_NUM_PROCESSES
    process_id: int = -1  # -1 = $RHYME_PROCESS_ID

    def __post_init__(self):
        check_fields(self)
        axes = ("data", "fsdp", "tensor")
        for name in axes:
            if getattr(self, name) == 0 or getattr(self, name) < -1:
                raise fail(self, name, "must be >= 1 or -1 (the devices left)")
        fill = [name for name in axes if getattr(self, name) == -1]
        if len(fill) > 1:
            raise ConfigError(f"parallel.{fill[0]} and parallel.{fill[1]} are both -1; at most one may fill")
        at_least(self, 1, "rollout_tensor")
        at_least(self, 0, "rollout_workers", note=" (0 = local devices / rollout_tensor)")
        at_least(self, 0, "num_processes", note=" (0 = $RHYME_NUM_PROCESSES)")
        at_least(self, -1, "process_id", note=" (-1 = $RHYME_PROCESS_ID)")


@dataclass(frozen=True)
class SchedSection:
    """Rollout scheduling over the rollout workers (docs/architecture.md, "HistoPipe"; rhyme_jax/sched/)."""

    KEY: ClassVar[str] = "sched"

    mode: SchedMode = "fifo"  # fifo (groups split over workers in order) | histopipe
    pipeline: SchedPipeline = "sync"  # sync (on-policy) | one_step_off (rollout s+1 overlaps update s; staleness 1)
    cross_step: bool = False  # one_step_off: per-worker queues, a worker starts step s+1 when its part of s is done
    tier1: bool = True  # histopipe: ranking groups by predicted length, odd steps ascending / even descending
    tier2: bool = True  # histopipe: more workers for long groups (binary search on the makespan)
    migration: bool = True  # histopipe: tails longer than growth x predicted move to an idle worker
    num_groups: int = 0  # ranking groups; 0 = max(1, workers // 2)
    placement: SchedPlacement = "tiers"  # histopipe: tiers (the paper's tier 1 + 2) | exact (whole prompts, least predicted makespan: sched/exact_placement.py) | spread (every prompt's samples over all workers: sched/spread_placement.py)
    length_stat: LengthStat = "mean"  # length prediction from the last rollout
    growth: float = 1.5  # migration: generated > growth x predicted length
    tail_fraction: float = 0.1  # migration: the worker has at most this share of its rows unfinished
    cost_model: str = ""  # cost model JSON fitted to the engine's pass-cost profile (python -m benchmarks.schedule --mode profile); "" = placeholder

    def __post_init__(self):
        check_fields(self)
        at_least(self, 0, "num_groups", note=" (0 = auto)")
        above(self, 0.0, "growth")
        if not 0.0 < self.tail_fraction <= 1.0:
            raise fail(self, "tail_fraction", "must be in (0, 1]")
        if self.cross_step and self.pipeline != "one_step_off":
            raise ConfigError(f"sched.cross_step=true needs sched.pipeline=one_step_off "
                              f"(got sched.pipeline={self.pipeline!r})")
        if self.cost_model and not Path(self.cost_model).is_file():
            raise fail(self, "cost_model", "is not a file (a profiled cost model JSON; '' = placeholder)")


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRASection:
    """LoRA adapters for GRPO (docs/lora.md; TRL ``peft_config`` = PEFT ``LoraConfig``): the base
    weights stay frozen, only the adapters are trained, checkpointed and held by the optimizer."""

    KEY: ClassVar[str] = "lora"

    rank: int = 0  # adapter rank r (PEFT r); 0 = off: GRPO trains every weight
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank (PEFT lora_alpha)
    dropout: float = 0.0  # drop probability of the adapter's input features in the update (PEFT lora_dropout)
    # projections of every decoder block that get an adapter (PEFT target_modules; all seven = PEFT "all-linear")
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS), hash=False)

    def __post_init__(self):
        check_fields(self)
        at_least(self, 0, "rank", note=" (0 = off)")
        above(self, 0.0, "alpha")
        if not 0.0 <= self.dropout < 1.0:
            raise fail(self, "dropout", "must be in [0, 1)")
        if not self.target_modules or any(t not in LORA_TARGETS for t in self.target_modules):
            raise fail(self, "target_modules", f"must be a non-empty list of {list(LORA_TARGETS)}")
        if len(set(self.target_modules)) < len(self.target_modules):
            raise fail(self, "target_modules", "names a projection twice")
