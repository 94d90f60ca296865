"""HF safetensors checkpoints <-> ``Decoder``.

``load_hf_checkpoint`` reads ``config.json`` and every ``*.safetensors`` file of a directory
(mmap via ``safetensors.safe_open``; bf16 arrives as ``ml_dtypes.bfloat16`` numpy arrays), maps HF
names to our parameters with one table per family, checks names and shapes, casts to the param
dtype and fills an abstract (``nnx.eval_shape``) model, so a large model is never randomly
initialised. ``save_hf_checkpoint`` writes the same layout back (HF transformers can load it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from rhyme_jax.model.config import ModelConfig
from rhyme_jax.model.transformer import Decoder
from rhyme_jax.parallel.rules import param_shardings


class CheckpointFormatError(ValueError):
    """A checkpoint's tensors do not match its config: names the files and the missing,
    unexpected or mis-shaped keys."""


class _Entry(NamedTuple):
    hf_suffix: str  # name after "model.layers.{i}." (or the full name for global entries)
    path: tuple  # our parameter path after ("layers",) (or the full path)
    transpose: bool  # HF Linear weight [out, in] vs nnx kernel [in, out]
    when: Callable[[ModelConfig], bool]


def _always(cfg: ModelConfig) -> bool:
    return True


def _bias(cfg: ModelConfig) -> bool:
    return cfg.attention_bias


def _o_bias(cfg: ModelConfig) -> bool:
    return cfg.o_bias


_COMMON_LAYER = [
    _Entry("input_layernorm.weight", ("input_norm", "weight"), False, _always),
    _Entry("post_attention_layernorm.weight", ("post_attn_norm", "weight"), False, _always),
    *[_Entry(f"self_attn.{p}_proj.weight", ("attn", f"{p}_proj", "kernel"), True, _always) for p in "qkvo"],
    *[_Entry(f"mlp.{p}_proj.weight", ("mlp", f"{p}_proj", "kernel"), True, _always)
      for p in ("gate", "up", "down")],
]
_QKV_BIAS = [_Entry(f"self_attn.{p}_proj.bias", ("attn", f"{p}_proj", "bias"), False, _bias) for p in "qkv"]
_O_BIAS = [_Entry("self_attn.o_proj.bias", ("attn", "o_proj", "bias"), False, _o_bias)]
_QK_NORM = [_Entry(f"self_attn.{p}_norm.weight", ("attn", f"{p}_norm", "weight"), False, _always) for p in "qk"]

# One table per family: HF layer-local names -> our layer-local parameter paths.
LAYER_TABLES: dict[str, list[_Entry]] = {
    "llama": _COMMON_LAYER + _QKV_BIAS + _O_BIAS,  # biases only when attention_bias (rare)
    "qwen2": _COMMON_LAYER + _QKV_BIAS,  # q/k/v biases always, no o bias
    "qwen3": _COMMON_LAYER + _QK_NORM + _QKV_BIAS + _O_BIAS,
}
GLOBAL_TABLE: list[_Entry] = [
    _Entry("model.embed_tokens.weight", ("embed", "embedding"), False, _always),
    _Entry("model.norm.weight", ("final_norm", "weight"), False, _always),
    _Entry("lm_head.weight", ("lm_head", "kernel"), True, lambda c: not c.tie_word_embeddings),
]
# Present in some checkpoints, never parameters of ours.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class Target(NamedTuple):
    """Where one HF tensor goes: our parameter ``path``, the ``layer`` index on its stacked
    leading axis (None for global parameters) and whether it is transposed."""

    path: tuple
    layer: int | None
    transpose: bool


def key_map(cfg: ModelConfig) -> dict[str, Target]:
    """``{hf_name: Target}`` for every tensor a checkpoint of ``cfg`` holds.

    Decoder blocks are stacked (``transformer.stack_layers``): ``model.layers.{i}.X`` goes to
    row ``i`` of the ``[L, ...]`` parameter at ``("layers",) + path(X)``.
    """
    out = {e.hf_suffix: Target(e.path, None, e.transpose) for e in GLOBAL_TABLE if e.when(cfg)}
    for i in range(cfg.num_layers):
        for e in LAYER_TABLES[cfg.family]:
            if e.when(cfg):
                out[f"model.layers.{i}.{e.hf_suffix}"] = Target(("layers",) + e.path, i, e.transpose)
    return out


def _hf_shape(target: Target, ours: tuple) -> tuple:
    """The HF tensor shape of ``target`` given our parameter's shape."""
    shape = ours[1:] if target.layer is not None else ours
    return shape[::-1] if target.transpose else shape


def _abstract_model(cfg: ModelConfig, dtype, param_dtype) -> Decoder:
    return nnx.eval_shape(lambda: Decoder(cfg, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)))


def load_hf_checkpoint(path, *, dtype=jnp.float32, param_dtype=None,
                       mesh: jax.sharding.Mesh | None = None) -> tuple[ModelConfig, Decoder]:
    """Load a HF checkpoint directory (``config.json`` + ``*.safetensors``, sharded or not).

    Args:
      path: checkpoint directory.
      dtype: compute dtype of the returned model.
      param_dtype: parameter dtype the tensors are cast to; None = ``dtype`` (inference: the
        weights in the dtype they compute in). Training passes float32 (``train.policy``:
        float32 master weights under bf16 compute; a bf16 checkpoint widens exactly).
      mesh: place each tensor straight into its sharding on this mesh
        (``parallel.rules.param_shardings``): every device reads only its block from the
        memory-mapped file, so no device (and no host buffer) holds a full copy of the model.
        None = single default device.

    Returns:
      ``(cfg, model)`` with ``model`` a concrete ``Decoder``.

    Raises:
      ModelConfigError: ``config.json`` is missing or invalid (names the field).
      CheckpointFormatError: no safetensors files, a tensor name in two files, missing tensors,
        unexpected tensors or shape mismatches (all listed, with the files).
    """
    path = Path(path)
    cfg = ModelConfig.from_hf_dir(path)
    dtype = jnp.dtype(dtype)
    param_dtype = dtype if param_dtype is None else jnp.dtype(param_dtype)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointFormatError(f"{path}: no *.safetensors files")

    abstract = _abstract_model(cfg, dtype, param_dtype)
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    table = key_map(cfg)
    where: dict[str, Path] = {}
    problems: list[str] = []
    for file in files:
        with safe_open(str(file), framework="numpy") as f:
            for key in f.keys():
                if key in where:
                    problems.append(f"duplicate key {key!r} in {where[key].name} and {file.name}")
                    continue
                where[key] = file
                if key not in table:
                    ignorable = key.endswith(_IGNORED_SUFFIXES) or (
                        key == "lm_head.weight" and cfg.tie_word_embeddings)
                    if not ignorable:
                        problems.append(f"unexpected key {key!r} in {file.name}")
                    continue
                target = table[key]
                want = _hf_shape(target, tuple(flat[target.path].get_value().shape))
                got = tuple(f.get_slice(key).get_shape())
                if got != want:
                    problems.append(f"shape mismatch for {key!r} in {file.name}: got {list(got)}, "
                                    f"config expects {list(want)}")
    missing = [k for k in table if k not in where]
    problems += [f"missing key {k!r}" for k in missing]
    if problems:
        names = ", ".join(f.name for f in files)
        raise CheckpointFormatError(f"{path} ({names}): " + "; ".join(problems))

    np_dtype = np.dtype(param_dtype)
    shardings = None
    if mesh is not None:
        shardings = dict(nnx.to_flat_state(param_shardings(state, mesh)))
    sources: dict[tuple, list] = {}  # our path -> [(layer, hf key, file)]
    for key, target in table.items():
        sources.setdefault(target.path, []).append((target.layer, key, where[key], target.transpose))
    for our_path, parts in sources.items():
        shape = tuple(flat[our_path].get_value().shape)
        sharding = None if shardings is None else _leaf_sharding(shardings[our_path])
        flat[our_path].set_value(_read_param(parts, shape, sharding, np_dtype))
    return cfg, nnx.merge(graphdef, nnx.from_flat_state(flat))


def _leaf_sharding(entry):
    return entry.get_value() if hasattr(entry, "get_value") else entry


def _read_param(parts: list, shape: tuple, sharding, np_dtype) -> jax.Array:
    """One parameter of our layout ``shape`` from its HF tensors ``parts = [(layer, key, file,
    transpose)]`` (one global tensor, or one per row of a stacked ``[L, ...]`` parameter).

    With ``sharding`` every device block is read straight from the memory-mapped safetensors
    slices it covers; without it the whole array is read on the host and put on the default
    device. HF stores Linear weights transposed (``[out, in]``)."""
    stacked = parts[0][0] is not None
    by_layer = {layer: (key, file, transpose) for layer, key, file, transpose in parts}

    def read(layer, idx):
        key, file, transpose = by_layer[layer]
        with safe_open(str(file), framework="numpy") as f:
            view = f.get_slice(key)
            hf_idx = tuple(idx[::-1]) if transpose else tuple(idx)
            arr = view[hf_idx] if idx else view[...]
        arr = np.asarray(arr)
        return arr.T if transpose else arr

    def block(idx=None):
        idx = tuple(idx) if idx is not None else tuple(slice(None) for _ in shape)
        if not stacked:
            return np.ascontiguousarray(read(None, idx).astype(np_dtype))
        layers = range(shape[0])[idx[0]]
        return np.ascontiguousarray(np.stack([read(i, idx[1:]) for i in layers]).astype(np_dtype))

    if sharding is None:
        return jnp.asarray(block())
    return jax.make_array_from_callback(shape, sharding, block)


def save_hf_checkpoint(model: Decoder, path) -> None:
    """Write ``config.json`` + ``model.safetensors`` with HF tensor names (params' dtype kept).

    Tied models omit ``lm_head.weight`` (as transformers does). Creates ``path`` if needed.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    tensors = {}
    for key, target in key_map(cfg).items():
        arr = np.asarray(flat[target.path].get_value())
        arr = arr[target.layer] if target.layer is not None else arr
        tensors[key] = np.ascontiguousarray(arr.T if target.transpose else arr)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.to_hf_dict()
    hf["dtype"] = str(np.dtype(jnp.dtype(model.embed.embedding[...].dtype)))
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
