"""A LoRA run's checkpoint as Decoder params and as PEFT adapter files.

A LoRA run's checkpoints hold the adapters only (``train/lora_state.py``). Reading one back
(``rhyme-jax export``, ``rhyme-jax eval``) rebuilds the base params as the run started from them
and merges (``model.lora.merge_adapters``: ``W + (lora.alpha / lora.rank) A B``).

``peft_state_dict`` / ``write_peft_adapter`` write the adapters the way PEFT's
``save_pretrained`` does (``peft/utils/save_and_load.py``, ``get_peft_model_state_dict``, the
reference): ``adapter_model.safetensors`` with keys
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` (``[r, in]`` = our
``A[i].T``) and ``...lora_B.weight`` (``[out, r]`` = ``B[i].T``), the adapter name dropped, and
``adapter_config.json`` (a ``LoraConfig``: ``peft_type`` LORA, ``task_type`` CAUSAL_LM, ``r``,
``lora_alpha``, ``lora_dropout``, ``target_modules``), which ``peft.PeftModel.from_pretrained``
loads onto the base model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from rhyme_jax.io import checkpoint as ckpt
from rhyme_jax.model.config import ModelConfig
from rhyme_jax.model.lora import HF_PARENT, TARGETS, LoRASpec, adapter_pairs, merge_adapters
from rhyme_jax.train.lora_state import lora_spec, lora_structure

if TYPE_CHECKING:
    from rhyme_jax.config import RunConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # PeftModelForCausalLM -> LoraModel -> the transformers model


def load_adapters(cfg: RunConfig, model_cfg: ModelConfig, params_dir: str | Path) -> nnx.State:
    """A LoRA run's adapters from ``params_dir`` (``<run>/checkpoints/<step>`` or its ``params``),
    float32 on the default device.

    Raises:
      CheckpointError: the checkpoint does not hold adapters of ``lora.rank`` / ``lora.target_modules``
        on this architecture.
    """
    return ckpt.load_params(params_dir, lora_structure(model_cfg, cfg)[1])


def merged_params(cfg: RunConfig, base: Any, adapters: Any) -> nnx.State:
    """``base`` with the adapters merged into its kernels (``W + scale A B``, float32)."""
    return jax.jit(lambda b, a: merge_adapters(b, a, lora_spec(cfg).scale))(base, adapters)


def peft_state_dict(model_cfg: ModelConfig, adapters: Any, dtype=np.float32) -> dict[str, np.ndarray]:
    """PEFT's ``adapter_model.safetensors`` tensors of our adapters (module docstring): for every
    layer ``i`` and adapted projection, ``lora_A.weight = A[i].T`` ``[r, in]`` and
    ``lora_B.weight = B[i].T`` ``[out, r]``, in ``dtype``, C-contiguous."""
    out = {}
    for path, (a, b) in adapter_pairs(adapters).items():
        _, parent, name, _ = path
        a, b = np.asarray(a), np.asarray(b)
        for i in range(model_cfg.num_layers):
            stem = f"{PEFT_PREFIX}model.layers.{i}.{HF_PARENT[parent]}.{name}"
            out[f"{stem}.lora_A.weight"] = np.ascontiguousarray(a[i].T.astype(dtype))
            out[f"{stem}.lora_B.weight"] = np.ascontiguousarray(b[i].T.astype(dtype))
    return out


def peft_config(spec: LoRASpec, base_model: str) -> dict[str, Any]:
    """``adapter_config.json`` of a ``LoRASpec`` (PEFT ``LoraConfig`` fields; the others default)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": int(spec.rank), "lora_alpha": float(spec.alpha), "lora_dropout": float(spec.dropout),
            "target_modules": [t for t in TARGETS if t in spec.targets], "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "modules_to_save": None, "inference_mode": True}


def write_peft_adapter(dest: Path, spec: LoRASpec, model_cfg: ModelConfig, adapters: Any, *,
                       base_model: str = "", dtype=np.float32) -> None:
    """Write ``adapter_model.safetensors`` and ``adapter_config.json`` of ``adapters`` (``spec``'s
    rank, alpha, dropout and targets) into ``dest`` (PEFT's ``save_pretrained`` layout);
    ``base_model``: ``base_model_name_or_path`` of the config."""
    dest = Path(dest)
    save_file(peft_state_dict(model_cfg, adapters, dtype), str(dest / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (dest / ADAPTER_CONFIG).write_text(json.dumps(peft_config(spec, base_model), indent=2) + "\n")
