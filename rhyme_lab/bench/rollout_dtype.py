"""Sampler against trainer logprobs by rollout dtype (``python -m benchmarks.rollout_dtype``).

SmolLM2-135M-Instruct (the real-model workload's recipe, ``rhyme_lab.bench.real_workload``; float32
master weights) rolls out ``prompts`` of the recipe's train problems for exactly ``max_new_tokens``
tokens (no EOS) at the recipe's temperature, once per engine dtype (``EngineConfig.dtype``: the
bf16 engine runs a bf16 copy of the weights with bf16 KV pages). The trainer's float32 forward
(``grpo_step.make_logprob_fn``, the update's logprobs) then scores the same tokens. Per dtype, over
the response tokens: |trainer - sampler| (mean, p99, max, nats), the importance ratio
``exp(trainer - sampler)`` (mean, std, min, p1, p99, max) and what truncated importance sampling
at ``cap`` makes of it (``train.tis.truncated_is_weights``: mean / max weight, share clipped).
"""

from __future__ import annotations

import numpy as np

from rhyme_lab.bench import real_workload


def setup(n_prompts: int):
    """``(graphdef, f32 state, model_cfg, prompt token lists)`` of the workload."""
    import jax.numpy as jnp
    from flax import nnx

    from rhyme_jax.model.loader import load_hf_checkpoint
    from rhyme_jax.model.tokenizer import Tokenizer

    path = real_workload.model_dir()
    model_cfg, model = load_hf_checkpoint(path, dtype=jnp.float32)
    tokenizer = Tokenizer.from_file(path)
    graphdef, state = nnx.split(model)
    prompts = [tokenizer.encode(t) for t in real_workload.prompt_texts(real_workload.questions(n_prompts))]
    return graphdef, state, model_cfg, prompts


def rollout(graphdef, state, model_cfg, prompts, dtype: str, max_new: int, temperature: float, seed: int):
    """One rollout of every prompt by an engine computing in ``dtype``; returns the
    ``RolloutResult`` (tokens and the sampler's behaviour logprobs)."""
    import jax

    from rhyme_jax.rollout.engine import EngineConfig, RolloutEngine, SamplingParams

    page = 16
    max_prompt = -(-max(map(len, prompts)) // page) * page
    engine = RolloutEngine(graphdef, model_cfg, EngineConfig(
        max_slots=len(prompts), page_size=page, max_prompt_len=max_prompt, max_new_tokens=max_new, eos_ids=(),
        dtype=dtype))
    return engine.generate(state, prompts, SamplingParams(temperature=temperature, max_new_tokens=max_new),
                           jax.random.key(seed))


def compare(trainer: np.ndarray, sampler: np.ndarray, mask: np.ndarray, cap: float) -> dict[str, float]:
    """Statistics of the trainer's against the sampler's logprobs ``f32[B, T]`` on ``mask``."""
    from rhyme_jax.train.tis import truncated_is_weights

    on = mask > 0
    d = (trainer - sampler)[on].astype(np.float64)
    ratio = np.exp(d)
    _, tis = truncated_is_weights(trainer, sampler, mask, cap)
    out = {"tokens": int(on.sum()), "abs_diff_mean": float(np.abs(d).mean()),
           "abs_diff_p99": float(np.percentile(np.abs(d), 99)), "abs_diff_max": float(np.abs(d).max()),
           "ratio_mean": float(ratio.mean()), "ratio_std": float(ratio.std()), "ratio_min": float(ratio.min()),
           "ratio_p1": float(np.percentile(ratio, 1)), "ratio_p99": float(np.percentile(ratio, 99)),
           "ratio_max": float(ratio.max())}
    out.update({k.replace("tis/", "tis_"): float(v) for k, v in tis.items()})
    return out


def measure(n_prompts: int = 8, max_new: int = 64, dtypes=("bfloat16", "float32"), seed: int = 0,
            cap: float = 2.0) -> dict:
    """The report: ``{"setup": ..., "by_dtype": {dtype: compare(...)}}``."""
    import jax

    from rhyme_jax.train import grpo_step, losses

    temperature = real_workload.recipe().rollout.temperature
    graphdef, state, model_cfg, prompts = setup(n_prompts)
    logprob_fn = grpo_step.make_logprob_fn(graphdef, temperature)
    report = {"setup": {"model": real_workload.MODEL, "prompts": n_prompts, "max_new_tokens": max_new,
                        "temperature": temperature, "seed": seed, "cap": cap, "backend": jax.default_backend(),
                        "trainer": "float32 dense forward (grpo_step.make_logprob_fn)"}, "by_dtype": {}}
    for dtype in dtypes:
        res = rollout(graphdef, state, model_cfg, prompts, dtype, max_new, temperature, seed)
        batch = losses.sequence_batch(prompts, [t.tolist() for t in res.tokens], pad_id=0)
        seq = batch["tokens"].shape[1]
        sampler = losses.response_grid(res.logprobs, batch["prompt_lens"], seq)
        trainer = np.asarray(logprob_fn(state, {k: batch[k] for k in ("tokens", "positions", "attn_mask")}))
        report["by_dtype"][dtype] = compare(trainer, sampler, batch["loss_mask"][:, :-1], cap)
    return report
