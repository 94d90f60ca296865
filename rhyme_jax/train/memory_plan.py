"""Per-device memory of a run's training state and of one GRPO update, planned from shapes.

Everything comes from shapes (``train.state_memory.state_memory``) and from XLA's compiled memory
analysis with abstract weights (``train.update_memory``): nothing the size of the model is
allocated, so a real recipe can be planned on a laptop before renting hardware. ``rhyme-jax
memory`` and ``rhyme-jax train --dry-run`` print it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rhyme_jax.config import RunConfig
from rhyme_jax.model.config import ModelConfig

GIB = 2.0 ** 30


def model_config_of(cfg: RunConfig, model_config: str) -> tuple[ModelConfig, str]:
    """The architecture a command sizes: ``model_config`` (an HF config.json or its directory),
    else ``cfg.model.path``'s (a known model name is imported on first use), else the tiny demo
    model. Returns ``(ModelConfig, source description)``.

    Raises:
      ModelConfigError: the config.json is missing or invalid.
    """
    source = model_config or cfg.model.path
    if source and not model_config:
        from rhyme_jax.model import hub

        source = str(hub.ensure(source))  # a known model named in the config: imported on first use
    if source:
        path = Path(source)
        return ModelConfig.from_hf_dir(path.parent if path.is_file() else path), str(source)
    from types import SimpleNamespace

    from rhyme_jax.train.policy import tiny_model_config

    # The demo tokenizer's size, without training it.
    tok = SimpleNamespace(vocab_size=cfg.data.tokenizer_vocab_size, eos_id=1)
    return tiny_model_config(cfg, tok), "tiny demo model"


def memory_report(cfg: RunConfig, *, model_config: str = "", devices: int = 0, rows: int = 0, tokens: int = 0,
                  update: bool = True, mean_tokens: int = 0) -> dict[str, Any]:
    """The numbers ``rhyme-jax memory`` prints (bytes, ints): ``state`` (float32 master params +
    AdamW moments per device on the train mesh, whatever ``model.dtype`` computes in),
    ``rollout_param_bytes_per_device`` (the copy a worker holds, in ``rollout_dtype``: ``rollout.dtype``,
    else ``model.dtype``; a LoRA run's merged weights), ``trainable_params`` (a LoRA run, ``lora.rank > 0``: the adapters; params then count
    base + adapters and the optimizer state covers the adapters only), and unless ``--no-update``
    the update's compiled memory (``train.update_memory``) plus ``peak_bytes_per_device`` =
    params + optimizer per device + ``update_temp_bytes`` (an upper bound under FSDP: the
    compiled update is single-device, so its gradients are whole).

    Args:
      model_config: an HF config.json (or its directory) to size instead of the config's model.
      devices: devices to plan for (fills a -1 mesh axis); 0 = this machine's.
      rows, tokens: the update's micro-batch per device; 0 = the config's.
      update: compile the update (abstract weights) and report its temporaries.
      mean_tokens: mean real tokens per sequence (prompt + response); with ``grpo.padding_free``
        the update packs the rows' tokens into ``packed_rows = ceil(rows x mean_tokens / tokens)``
        full rows (``train/packing.py``; first-fit leaves a little more in practice), and that
        is what is planned. 0 = plan the padded rows. With ``grpo.pack_lengths`` the plan is
        one call of the largest buffer length (``micro_batch_tokens // length`` rows, at least one),
        the call whose attention temporaries are the largest.

    Raises:
      ModelConfigError: the model's config.json is missing or invalid.
      MeshConfigError: the mesh does not fit ``devices``.
    """
    import jax

    import numpy as np

    from rhyme_jax.parallel.mesh import mesh_shape
    from rhyme_jax.train.optim import PARAM_DTYPE
    from rhyme_jax.train.state_memory import state_memory

    model_cfg, source = model_config_of(cfg, model_config)
    devices = devices if devices > 0 else jax.device_count()
    p = cfg.parallel
    d, f, t = mesh_shape(p.data, p.fsdp, p.tensor, devices)
    dtype, param_dtype = cfg.model.dtype, str(np.dtype(PARAM_DTYPE))
    from rhyme_jax.train.lora_state import lora_spec

    train = state_memory(model_cfg, {"data": d, "fsdp": f, "tensor": t}, param_dtype=param_dtype,
                         lora=lora_spec(cfg))
    roll_dtype = cfg.rollout.dtype or dtype
    roll = state_memory(model_cfg, {"tensor": p.rollout_tensor}, param_dtype=roll_dtype)
    out = {"model": source, "dtype": dtype, "param_dtype": param_dtype, "rollout_dtype": roll_dtype,
           "devices": devices,
           "mesh": {"data": d, "fsdp": f, "tensor": t},
           "lora_rank": cfg.lora.rank,
           **{k: train[k] for k in ("params", "trainable_params", "param_bytes_total", "param_bytes_per_device",
                                    "opt_bytes_total", "opt_bytes_per_device")},
           "rollout_tensor": p.rollout_tensor, "rollout_param_bytes_per_device": roll["param_bytes_per_device"]}
    if update:
        from rhyme_jax.train.update_memory import config_micro_batch, update_memory

        plan_rows, plan_tokens = config_micro_batch(cfg, d * f)
        lengths = cfg.grpo.pack_lengths
        if lengths:  # the calls of the largest class hold the most attention (train/length_classes.py)
            plan_rows, plan_tokens = max(1, (cfg.grpo.micro_batch_tokens or lengths[-1]) // lengths[-1]), lengths[-1]
            out["pack_lengths_call"] = True
        rows, tokens = rows or plan_rows, tokens or plan_tokens
        if cfg.grpo.padding_free and mean_tokens > 0 and not lengths:
            out["padded_rows"] = rows
            rows = max(1, -(-rows * min(mean_tokens, tokens) // tokens))
        upd = update_memory(model_cfg, cfg, rows, tokens)
        out.update(upd)
        out["peak_bytes_per_device"] = (train["param_bytes_per_device"] + train["opt_bytes_per_device"]
                                        + upd["update_temp_bytes"])
    return out


def print_report(r: dict[str, Any]) -> None:
    """Human-readable ``memory_report``."""
    m = r["mesh"]
    print(f"{r['model']}: {r['params'] / 1e9:.3f} B parameters, {r['param_dtype']} master weights "
          f"computing in {r['dtype']}")
    if r.get("lora_rank"):
        print(f"LoRA rank {r['lora_rank']}: {r['trainable_params'] / 1e6:.3f} M trainable adapter parameters "
              f"({100 * r['trainable_params'] / r['params']:.2f} %); base weights frozen, AdamW moments for the adapters only")
    print(f"train mesh data={m['data']} x fsdp={m['fsdp']} x tensor={m['tensor']} of {r['devices']} devices:")
    for name, key, note in (("params", "param", ""), ("optimizer", "opt", " (AdamW moments)")):
        print(f"  {name:<10} {r[key + '_bytes_total'] / GIB:8.3f} GiB total  "
              f"{r[key + '_bytes_per_device'] / GIB:8.3f} GiB per device{note}")
    both = r["param_bytes_per_device"] + r["opt_bytes_per_device"]
    print(f"  together   {(r['param_bytes_total'] + r['opt_bytes_total']) / GIB:8.3f} GiB total  "
          f"{both / GIB:8.3f} GiB per device")
    print(f"rollout worker (tensor={r['rollout_tensor']}): params "
          f"{r['rollout_param_bytes_per_device'] / GIB:.3f} GiB per device in {r['rollout_dtype']} (plus the KV pool)")
    if "update_temp_bytes" in r:
        packed = f" (grpo.padding_free: {r['padded_rows']} padded rows packed)" if "padded_rows" in r else ""
        if r.get("pack_lengths_call"):
            packed = " (grpo.pack_lengths: one call of the largest buffer length, the update's peak)"
        print(f"one update over {r['rows']} rows x {r['tokens']} tokens per device{packed} "
              f"(logit_chunk={r['logit_chunk']}, remat={r['remat']}; XLA compiled in {r['compile_s']} s):")
        print(f"  temporaries {r['update_temp_bytes'] / GIB:8.3f} GiB  (of which ~{r['residual_bytes'] / GIB:.3f} "
              f"GiB block inputs, {r['logits_chunk_bytes'] / GIB:.3f} GiB one logits chunk)")
        print(f"  peak        {r['peak_bytes_per_device'] / GIB:8.3f} GiB per device "
              f"(params + optimizer + temporaries)")
