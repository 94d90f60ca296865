"""TRL 1.x's ``GRPOTrainer`` settings mapped from a rhyme-jax config (docs/trl_mapping.md) for
``python -m benchmarks.trl_side_by_side``: the seeds to compare, the ``GRPOConfig`` keyword
arguments, what TRL cannot match, the ``--steps`` truncation rule, the prompt schedule both sides
follow, and a checkpoint directory TRL can load. No TRL import here (``trl_model_dir`` imports
transformers inside).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

from rhyme_jax.config import load_config
from rhyme_jax.train.optim import make_optimizer
from rhyme_jax.train.prompts import num_grpo_prompts, prompt_schedule


class SideBySideError(ValueError):
    """The side-by-side comparison cannot run as asked (the message says why, naming the option)."""


# grpo.loss_agg -> TRL loss_type (docs/trl_mapping.md, "Key mapping")
LOSS_TYPES = {"token_mean": "bnpo", "seq_mean_token_mean": "grpo", "seq_mean_token_sum_norm": "dr_grpo",
              "step_token_mean": "dapo"}
SCHEDULES = {"constant": "constant_with_warmup", "cosine": "cosine"}


def seed_runs(args) -> list[dict]:
    """``[{seed, cfg, rhyme_dir}]``: one per ``--seeds`` value (``rhyme_dir`` None: to be run), or
    one per ``--rhyme-run-dir`` (its config.yaml, its seed).

    Raises:
      SideBySideError: a named run directory has no config.yaml, --set is combined with it,
        --steps without one, or ``truncated`` refuses ``args.steps``.
    """
    dirs = [d for item in args.rhyme_run_dir for d in item.split(",") if d.strip()]
    if dirs:
        if args.overrides:
            raise SideBySideError("--set with --rhyme-run-dir: the TRL run takes each rhyme-jax run's own config")
        out = []
        for d in dirs:
            if not (Path(d) / "config.yaml").is_file():
                raise SideBySideError(f"--rhyme-run-dir {d}: no config.yaml (not a rhyme-jax run directory)")
            full = load_config(Path(d) / "config.yaml")
            cfg = truncated(full, args.steps, d)
            out.append({"seed": int(cfg.run.seed), "cfg": cfg, "rhyme_dir": Path(d), "eval_step": full.grpo.steps})
        return out
    if args.steps:
        raise SideBySideError("--steps needs --rhyme-run-dir (a finished run whose first steps are compared)")
    base = load_config(args.config, args.overrides)
    seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    return [{"seed": s, "cfg": load_config(args.config, args.overrides + [
        f"run.seed={s}", f"run.name={base.run.name}_s{s}"]), "rhyme_dir": None} for s in seeds]

def adam_defaults() -> dict:
    """b1, b2, eps of rhyme-jax's AdamW (``train/optim.make_optimizer``'s defaults)."""
    params = inspect.signature(make_optimizer).parameters
    return {k: params[k].default for k in ("b1", "b2", "eps")}

def scale_rewards(g) -> str:
    """``grpo.scale_rewards`` (``group`` / ``batch`` / ``none``), from the older ``scale_by_std`` too."""
    value = getattr(g, "scale_rewards", None)
    if value is None:
        value = "group" if getattr(g, "scale_by_std", True) else "none"
    return str(value)

def trl_settings(cfg, *, attn: str = "sdpa", cpu: bool = True) -> dict:
    """``GRPOConfig`` keyword arguments mapped from a rhyme-jax config (docs/trl_mapping.md), minus
    ``output_dir``. One generation per GRPO step, ``grpo.minibatches`` optimizer steps each."""
    g, r = cfg.grpo, cfg.rollout
    rows, mb = g.prompts_per_step * g.samples_per_prompt, g.minibatches
    adam = adam_defaults()
    return dict(
        num_generations=g.samples_per_prompt, per_device_train_batch_size=rows // mb, steps_per_generation=mb,
        gradient_accumulation_steps=1, num_iterations=1, max_steps=g.steps * mb, shuffle_dataset=False,
        learning_rate=g.learning_rate, lr_scheduler_type=SCHEDULES[g.schedule], warmup_steps=g.warmup_steps * mb,
        weight_decay=g.weight_decay, max_grad_norm=g.max_grad_norm, optim="adamw_torch",
        adam_beta1=adam["b1"], adam_beta2=adam["b2"], adam_epsilon=adam["eps"],
        epsilon=g.eps_low, epsilon_high=g.eps_high, beta=g.kl_coef, use_bias_correction_kl=False,
        loss_type=LOSS_TYPES[g.loss_agg], scale_rewards=scale_rewards(g),
        temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, max_completion_length=r.max_new_tokens,
        seed=int(cfg.run.seed), data_seed=int(cfg.run.seed), gradient_checkpointing=bool(g.remat),
        bf16=cfg.model.dtype == "bfloat16", fp16=False, use_cpu=cpu, use_vllm=False, disable_dropout=True,
        model_init_kwargs={"dtype": "float32", "attn_implementation": attn},
        report_to=[], logging_steps=1, save_strategy="no", log_completions=False, dataloader_pin_memory=False,
        remove_unused_columns=False,
    )

def unmatched(cfg, *, starts_from_sft: bool, overlong: int) -> list[dict]:
    """Settings of the rhyme-jax run that TRL 1.x cannot reproduce, each with the reason."""
    g, out = cfg.grpo, []

    def add(setting: str, why: str):
        out.append({"setting": setting, "why": why})

    if cfg.spec.enabled:
        add("spec.* (HistoSpec drafting, window=%s)" % cfg.spec.window,
            "speculative drafts from earlier rollouts verified by the policy; lossless (the tokens keep the "
            "sampling distribution), so it changes rollout seconds only. TRL's generation here is plain "
            "transformers `generate`, which has no drafting")
    add("rollout engine (paged KV pool, continuous batching: rollout.max_slots, page_size, num_pages, "
        "share_prompt_prefix, attention_impl, max_verify_tokens)",
        "engine internals with no TRL knob; TRL pads the generation batch and calls `generate` once")
    add("rollout.max_prompt_len / on_overlong_prompt", "TRL 1.x does not cap prompts; "
        f"{overlong} scheduled prompt(s) exceed max_prompt_len={cfg.rollout.max_prompt_len}")
    add("sampling random numbers", "JAX keys vs torch's generator: the same run.seed does not draw the same "
        "completions, so the curves are compared as samples (means, standard errors), not token by token")
    add("behaviour log-probs", "recorded by the rollout engine on our side; TRL recomputes them with a "
        "training forward pass (steps_per_generation > 1) or takes the detached current ones: the same "
        "quantity up to float rounding, on TRL's update clock")
    if g.minibatches > 1:
        add(f"grpo.minibatches={g.minibatches} (row assignment)", "TRL shuffles the rows of a generation "
            "(`shuffle_sequence_dict`, not configurable) before cutting it into steps_per_generation slices; "
            "our minibatches are consecutive groups. Same number of rows per optimizer step")
    add("grpo.micro_batch_tokens / logit_chunk", "memory only (the loss does not depend on the split); TRL "
        "runs each slice in one pass (gradient_accumulation_steps=1)")
    add("grpo.max_consecutive_nonfinite", "we skip updates with a non-finite loss or gradient; the HF "
        "Trainer applies them")
    if cfg.sched.pipeline != "sync" or cfg.sched.mode != "fifo":
        add(f"sched.pipeline={cfg.sched.pipeline}, sched.mode={cfg.sched.mode}",
            "TRL without vLLM is synchronous on one generation worker: no staleness-1 rollouts or HistoPipe")
    if cfg.run.eval_samples:
        add("run.eval_samples (mean@k)", "only greedy accuracy is measured on the TRL side")
    if cfg.model.dtype == "bfloat16":
        add("model.dtype=bfloat16", "TRL uses bf16 autocast over float32 weights; we cast inside each layer")
    if starts_from_sft:
        add("starting weights", "the rhyme-jax run starts from an SFT warm start / run.init_from; TRL starts "
            "from model.path, so the two runs do NOT start from the same policy")
    add("held-out evaluation engine", "ours: the paged JAX engine; TRL's policy: batched left-padded "
        "transformers `generate`. Same problems, prompt tokens, EOS, max tokens and reward; float "
        "rounding can flip greedy near-ties (`before_agreement` in the report)")
    return out

def truncated(cfg, steps: int, where: str):
    """``cfg`` with ``grpo.steps = steps`` (0: unchanged), allowed only where a run of ``steps``
    steps is the longer run's beginning: a constant learning rate without warm-up.

    Raises:
      SideBySideError: ``steps`` out of range, or a schedule under which the runs would differ.
    """
    if not steps:
        return cfg
    g = cfg.grpo
    if not 1 <= steps <= g.steps:
        raise SideBySideError(f"--steps {steps}: must be in [1, {g.steps}] (the steps of {where})")
    if g.schedule != "constant" or g.warmup_steps:
        raise SideBySideError(f"--steps: {where} uses grpo.schedule={g.schedule}, warmup_steps={g.warmup_steps}; its "
                         "first steps are a shorter run's only under a constant rate without warm-up")
    return dataclasses.replace(cfg, grpo=dataclasses.replace(g, steps=steps))

def schedule_rows(cfg, num_train: int) -> list[tuple[int, int]]:
    """``(GRPO step, train problem index)`` of every prompt the run uses, in rhyme-jax's order."""
    g = cfg.grpo
    n_prompts = num_grpo_prompts(cfg, num_train)
    return [(s, int(i)) for s in range(1, g.steps + 1)
            for i in prompt_schedule(cfg.run.seed, n_prompts, s, g.prompts_per_step)]

def expected_prompt_ids(cfg, num_train: int) -> list[list[int]]:
    """Per GRPO step, the problem index of each of its rows (each prompt ``samples_per_prompt``
    times in a row): what both trainers must see."""
    n, out = cfg.grpo.samples_per_prompt, {}
    for s, i in schedule_rows(cfg, num_train):
        out.setdefault(s, []).extend([i] * n)
    return [out[s] for s in sorted(out)]

def trl_model_dir(path: str, out_dir: Path) -> str:
    """A checkpoint directory TRL 1.x can load: ``path`` itself when its config.json names the model
    class (``architectures``), else ``out_dir/model``: links to ``path``'s files and a config.json
    with ``architectures`` added (TRL's ``create_model_from_path`` reads it, for the policy and the
    KL reference; checkpoints imported from GGUF, e.g. ``smollm2-135m-instruct``, have none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    src = Path(path).resolve()
    config = json.loads((src / "config.json").read_text())
    if config.get("architectures"):
        return str(src)
    view = Path(out_dir) / "model"
    view.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        link = view / f.name
        if f.name != "config.json" and not link.exists():
            link.symlink_to(f)
    config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]
    (view / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return str(view)

def our_eos(path: str, ours) -> list[int]:
    """The ids that end a rhyme-jax response (``policy.eos_ids``): the tokenizer's EOS plus the
    checkpoint's ``eos_token_id``."""
    declared = json.loads((Path(path) / "config.json").read_text()).get("eos_token_id")
    declared = [] if declared is None else declared if isinstance(declared, list) else [declared]
    return sorted({int(ours.eos_id), *(int(i) for i in declared)})
