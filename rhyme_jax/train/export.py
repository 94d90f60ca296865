"""``export_hf``: a run's trained policy as a Hugging Face checkpoint directory (transformers, vLLM).

The inverse of the import path (``model.loader.load_hf_checkpoint``): the policy params of one
checkpoint of a run (``<run>/checkpoints/<step>/params``, float32 master weights in the stacked
``[L, ...]`` layer layout) are mapped back through the same name table (``loader.key_map``:
``model.layers.{i}.X`` is row ``i`` of the stacked parameter; Linear kernels ``[in, out]`` are
transposed to HF's ``[out, in]``; a tied model has no ``lm_head.weight``), cast to the dtype of the
checkpoint the run started from and written as one ``model.safetensors``. Beside it:

* a run from a HF checkpoint (``model.path``): that directory's ``config.json`` and
  ``generation_config.json`` and the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``,
  ``special_tokens_map.json``, the chat template, ...) copied unchanged;
* the demo's tiny model (``model.path: ""``, no HF source): ``config.json`` built from its
  ``ModelConfig`` (``model_type`` = ``model.tiny.family``, float32), the run's own demo
  ``tokenizer.json`` (a HF ``tokenizers`` file) with a ``tokenizer_config.json`` naming its
  ``<eos>`` / ``<pad>`` / ``<unk>`` tokens for ``PreTrainedTokenizerFast``, a chat template derived
  from ``model.prompt_template`` and a ``generation_config.json``.

A run that rendered its prompts with a jinja file (``model.chat_template: <file>``) exports that
file as ``chat_template.jinja`` (transformers reads it before ``tokenizer_config.json``'s).

A LoRA run (``lora.rank > 0``; docs/lora.md) checkpoints its adapters only: the export merges them
into the base it started from (``W + (alpha / r) A B``, ``model.safetensors`` as above) and writes
the adapters for PEFT in ``adapter/`` (``adapter_model.safetensors`` + ``adapter_config.json``,
``train/lora_export.py``; a subdirectory because transformers / vLLM read every ``*.safetensors``
beside ``config.json``), so ``peft.PeftModel.from_pretrained(base, out_dir / "adapter")`` loads them.

Every export also holds ``rhyme_jax_export.json`` (run, step, source, dtype, the run's
``model.prompt_template``, ``model.chat_template`` and ``model.system_prompt``: the prompt format
the policy was trained on).

Everything is checked before anything is written (run directory, ``config.yaml``, checkpoint,
source model, tokenizer, destination); the directory is assembled in a temporary sibling and
renamed into place, so ``out_dir`` appears complete or not at all. Checkpoints are read without an
orbax ``CheckpointManager`` (which would clean up the temporary directories of a run saving right
now), so a run may be exported while it trains. The whole model passes through host memory once
(float32 + the cast copy), on one host.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import string
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file
from tokenizers import Tokenizer as _HFTokenizer

from rhyme_jax.config import RunConfig, load_config
from rhyme_jax.io import checkpoint as ckpt
from rhyme_jax.model import hub
from rhyme_jax.model.config import ModelConfig
from rhyme_jax.model.loader import key_map, load_hf_checkpoint
from rhyme_jax.model.tokenizer import Tokenizer
from rhyme_jax.model.transformer import Decoder
from rhyme_jax.train.lora_export import load_adapters, merged_params, write_peft_adapter
from rhyme_jax.train.lora_state import lora_spec
from rhyme_jax.train.optim import PARAM_DTYPE
from rhyme_jax.train.policy import build_model, tiny_model_config, tokenizer_file

EXPORT_MARKER = "rhyme_jax_export.json"
ADAPTER_DIR = "adapter"  # a LoRA run's PEFT adapter files, inside the export
INITIAL = "initial"  # ``step=INITIAL``: the params GRPO starts from (as ``rhyme-jax eval --checkpoint initial``)
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "float16": np.dtype(np.float16)}
# Copied from the source model directory when present (tokenizer files: from the directory of the
# run's tokenizer.json first, i.e. ``model.tokenizer_path``'s when that is set).
_MODEL_FILES = ("config.json", "generation_config.json")
_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "chat_template.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model")


class ExportError(ValueError):
    """A run cannot be exported: one line naming the path (missing run directory, config.yaml,
    checkpoint, source model or tokenizer; unknown step or dtype; destination not empty)."""


@dataclass(frozen=True)
class RunSource:
    """What a run's policy is: its config, architecture and where it started.

    Attributes:
      cfg: the run's ``config.yaml``.
      model_cfg: the decoder architecture (from ``model.path``'s config.json, or ``model.tiny``
        with the run's tokenizer vocabulary).
      model_dir: the HF checkpoint the run started from; None for the tiny demo model.
      tokenizer_file: the run's ``tokenizer.json``.
      dtype: name of the HF source dtype (a key of ``DTYPES``); ``"float32"`` for the tiny model.
    """

    cfg: RunConfig
    model_cfg: ModelConfig
    model_dir: Path | None
    tokenizer_file: Path
    dtype: str


def run_source(run_dir: Path) -> RunSource:
    """Read ``<run_dir>/config.yaml`` and the source model's config (no weights are read).

    Raises:
      ExportError: no run directory / config.yaml, the source model directory or the tokenizer
        file is missing, or the source config.json names a dtype not in ``DTYPES``.
      ConfigError: config.yaml is invalid under the current schema (names the file and key).
      ModelConfigError: the source config.json is invalid or an unsupported architecture
        (``model_type`` not qwen2 / qwen3 / llama; names the file and field).
      TokenizerError: the tokenizer file is unreadable.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: run directory not found")
    if not (run_dir / "config.yaml").is_file():
        raise ExportError(f"{run_dir / 'config.yaml'}: not found (is {run_dir} a rhyme-jax run directory?)")
    cfg = load_config(run_dir / "config.yaml")
    tok_file = tokenizer_file(cfg, run_dir)
    if not cfg.model.path:
        if not tok_file.is_file():
            raise ExportError(f"{tok_file}: the run's demo tokenizer is missing")
        return RunSource(cfg, tiny_model_config(cfg, Tokenizer.from_file(tok_file)), None, tok_file, "float32")
    model_dir = hub.resolve(cfg.model.path)  # a known model's name: its cache directory
    if not (model_dir / "config.json").is_file():
        raise ExportError(f"{model_dir}: source model directory (model.path of {run_dir / 'config.yaml'}) "
                          "has no config.json")
    if not tok_file.is_file():
        raise ExportError(f"{tok_file}: the run's tokenizer file is missing")
    model_cfg = ModelConfig.from_hf_dir(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        raise ExportError(f"{model_dir / 'config.json'}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return RunSource(cfg, model_cfg, model_dir, tok_file, dtype)


def params_location(run_dir: Path, source: RunSource, step: int | str | None) -> tuple[Path | None, str]:
    """The params directory to export and a label for it.

    Args:
      step: None = the newest complete checkpoint; an int = that step; ``"initial"`` = the
        params GRPO starts from (``run.init_from``, else ``<run>/sft/params``, else the source
        model / the tiny model initialised from ``run.seed``: then the directory is None).

    Raises:
      ExportError: no complete checkpoint, or ``step`` is not one of them.
    """
    run_dir = Path(run_dir)
    if isinstance(step, str) and step.isdigit():  # "30" from a command line
        step = int(step)
    if step == INITIAL:
        from rhyme_jax.train.assembly import warm_start_dir  # heavy (rollout engine): only here

        warm = warm_start_dir(source.cfg, run_dir)
        origin = str(source.model_dir) if source.model_dir else f"tiny model, seed {source.cfg.run.seed}"
        return warm, f"initial ({warm or origin})"
    ckpt_dir = run_dir / "checkpoints"
    steps = ckpt.complete_steps(ckpt_dir)
    if not steps:
        raise ExportError(f"{ckpt_dir}: no complete checkpoint (step='initial' exports the starting model)")
    if step is None:
        step = steps[-1]
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or int(step) not in steps:
        raise ExportError(f"{ckpt_dir}: no complete checkpoint for step {step!r} (have {steps})")
    return ckpt_dir / str(int(step)), f"step {int(step)}"


def load_policy_params(source: RunSource, params_dir: Path | None) -> nnx.State:
    """The float32 policy params (the train layout: stacked ``[L, ...]`` layers, kernels
    ``[in, out]``) from ``params_dir`` (a ``<step>`` / ``sft`` / params directory), or the
    starting model when it is None. Only ``params`` is read (not the optimizer state).

    Raises:
      CheckpointError: the params do not match the run's architecture (names the entry).
    """
    if params_dir is None:
        if source.model_dir is not None:
            _, model = load_hf_checkpoint(source.model_dir, dtype=PARAM_DTYPE, param_dtype=PARAM_DTYPE)
        else:
            model = build_model(source.cfg, Tokenizer.from_file(source.tokenizer_file), source.cfg.run.seed)
        return nnx.state(model)
    abstract = nnx.eval_shape(lambda: Decoder(source.model_cfg, dtype=PARAM_DTYPE, param_dtype=PARAM_DTYPE,
                                              rngs=nnx.Rngs(0)))
    return ckpt.load_params(params_dir, nnx.state(abstract))


def run_params(run_dir: Path, source: RunSource, params_dir: Path | None, *, initial: bool) -> tuple[nnx.State, Any]:
    """``(params, adapters)`` to export: a full-weight run's (or any ``initial``) params and None;
    a LoRA run's (``lora.rank > 0``) checkpoint: the base it started from (``run.init_from`` /
    ``<run>/sft/params`` / the source model) with the checkpoint's adapters merged
    (``lora_export.merged_params``) and those adapters.

    Raises:
      CheckpointError: the checkpoint does not match the run's architecture or adapters.
    """
    if source.cfg.lora.rank == 0 or initial:
        return load_policy_params(source, params_dir), None
    from rhyme_jax.train.assembly import warm_start_dir  # heavy (rollout engine): only here

    base = load_policy_params(source, warm_start_dir(source.cfg, Path(run_dir)))
    adapters = load_adapters(source.cfg, source.model_cfg, params_dir)
    return merged_params(source.cfg, base, adapters), adapters


def hf_state_dict(model_cfg: ModelConfig, params: Any, dtype=np.float32) -> dict[str, np.ndarray]:
    """Our params as HF tensors: the inverse of ``load_hf_checkpoint``'s mapping.

    Args:
      model_cfg: the architecture (``key_map`` gives the names).
      params: the decoder's params (``nnx.State`` or its flat mapping) in the train layout:
        ``layers/...`` stacked ``[L, ...]``, Linear kernels ``[in, out]``, any float dtype.
      dtype: numpy dtype of every output tensor (``DTYPES`` values; bf16 is ``ml_dtypes``).

    Returns:
      ``{hf_name: C-contiguous array}``: ``model.layers.{i}.*`` rows of the stacked params,
      Linear weights ``[out, in]``; ``lm_head.weight`` only when the embeddings are not tied.
    """
    flat = dict(nnx.to_flat_state(params)) if isinstance(params, nnx.State) else dict(params)
    dtype = np.dtype(dtype)
    out = {}
    for key, target in key_map(model_cfg).items():
        leaf = flat[target.path]
        arr = np.asarray(leaf.get_value() if hasattr(leaf, "get_value") else leaf)
        arr = arr[target.layer] if target.layer is not None else arr
        out[key] = np.ascontiguousarray((arr.T if target.transpose else arr).astype(dtype))
    return out


def export_hf(run_dir: str | Path, out_dir: str | Path, *, step: int | str | None = None,
              overwrite: bool = False) -> Path:
    """Write a run's policy as a HF checkpoint directory that transformers and vLLM load.

    Args:
      run_dir: a run directory (``runs/<name>``: ``config.yaml``, ``checkpoints/``, maybe ``sft/``).
      out_dir: directory to create. It must not exist (or be empty) unless ``overwrite``.
      step: None = the newest complete GRPO checkpoint; an int = that step; ``"initial"`` = the
        params GRPO starts from (``run.init_from``, the run's SFT warm start, else the source
        model or the tiny model freshly initialised from ``run.seed``).
      overwrite: replace an existing non-empty ``out_dir``.

    Returns:
      ``out_dir``, holding ``model.safetensors`` (the source model's dtype: float32 / bfloat16 /
      float16; float32 for the tiny demo model), ``config.json``, the tokenizer files and chat
      template, ``generation_config.json`` (when the source has one, always for the tiny model)
      and ``rhyme_jax_export.json``; for a LoRA run's checkpoint (``lora.rank > 0``) the merged
      weights and its adapters in PEFT's format in ``adapter/`` (``adapter_model.safetensors``,
      ``adapter_config.json``; ``train/lora_export.py``).

    Raises:
      ExportError: missing run directory / config.yaml / checkpoint / source model / tokenizer,
        unknown step or dtype, or a non-empty ``out_dir`` (one line naming the path; nothing is
        written).
      ConfigError, ModelConfigError, TokenizerError: invalid config.yaml, source config.json
        (unsupported architecture) or tokenizer file (see ``run_source``).
      CheckpointError: the checkpoint does not match the run's architecture.
    """
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    source = run_source(run_dir)
    params_dir, label = params_location(run_dir, source, step)
    if out_dir.exists() and not overwrite and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir}: already exists and is not empty (pass overwrite=True to replace it)")
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"{out_dir}: exists and is not a directory")
    params, adapters = run_params(run_dir, source, params_dir, initial=step == INITIAL)
    tensors = hf_state_dict(source.model_cfg, params, DTYPES[source.dtype])
    del params
    with _staging(out_dir) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        if adapters is not None:  # a LoRA run: its adapters for PEFT in a subdirectory (loaders read *.safetensors)
            (tmp / ADAPTER_DIR).mkdir()
            write_peft_adapter(tmp / ADAPTER_DIR, lora_spec(source.cfg), source.model_cfg, adapters,
                               base_model=source.cfg.model.path)
        if source.model_dir is not None:
            _copy_source_files(source, tmp)
        else:
            _write_tiny_files(source, tmp)
        if _chat_template_file(source.cfg):
            shutil.copyfile(_chat_template_file(source.cfg), tmp / "chat_template.jinja")
        meta = {"run_dir": str(run_dir.absolute()), "checkpoint": label, "params": str(params_dir or ""),
                "source": str(source.model_dir or "tiny demo model"), "dtype": source.dtype,
                "prompt_template": source.cfg.model.prompt_template,
                "chat_template": source.cfg.model.chat_template, "system_prompt": source.cfg.model.system_prompt,
                "lora_adapter": ADAPTER_DIR if adapters is not None else ""}
        (tmp / EXPORT_MARKER).write_text(json.dumps(meta, indent=1) + "\n")
    return out_dir


def _copy_source_files(source: RunSource, dest: Path) -> None:
    """config.json, generation_config.json and the tokenizer files of a HF source, unchanged."""
    for name in _MODEL_FILES:
        if (source.model_dir / name).is_file():
            shutil.copyfile(source.model_dir / name, dest / name)
    shutil.copyfile(source.tokenizer_file, dest / "tokenizer.json")
    for name in _TOKENIZER_FILES:
        for directory in (source.tokenizer_file.parent, source.model_dir):
            if (directory / name).is_file():
                shutil.copyfile(directory / name, dest / name)
                break


def _write_tiny_files(source: RunSource, dest: Path) -> None:
    """config.json, tokenizer.json + tokenizer_config.json (with a chat template) and
    generation_config.json of the tiny demo model, which has no HF source to copy."""
    model_cfg = source.model_cfg
    hf = model_cfg.to_hf_dict()
    # transformers 5 reads dtype / rope_parameters; 4.x (older vLLM installs) torch_dtype / rope_theta.
    hf.update(dtype="float32", torch_dtype="float32", rope_theta=model_cfg.rope_theta)
    (dest / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    shutil.copyfile(source.tokenizer_file, dest / "tokenizer.json")
    tok = Tokenizer.from_file(source.tokenizer_file)
    raw = _HFTokenizer.from_file(str(source.tokenizer_file))
    unk = getattr(raw.model, "unk_token", None)
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": raw.id_to_token(tok.eos_id),
               "pad_token": raw.id_to_token(tok.pad_id), "unk_token": unk,
               "model_max_length": model_cfg.max_position_embeddings, "clean_up_tokenization_spaces": False,
               "chat_template": chat_template(source.cfg.model.prompt_template)}
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    eos = sorted({tok.eos_id, *model_cfg.eos_token_ids})
    gen = {"eos_token_id": eos[0] if len(eos) == 1 else eos, "pad_token_id": tok.pad_id}
    (dest / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _chat_template_file(cfg: RunConfig) -> Path | None:
    """The jinja file of ``model.chat_template: <file>``, else None.

    Raises:
      ExportError: the file named in the run's config is gone.
    """
    if cfg.model.chat_template in ("none", "auto", "tokenizer"):
        return None
    path = Path(cfg.model.chat_template)
    if not path.is_file():
        raise ExportError(f"{path}: the run's model.chat_template file is missing")
    return path


def chat_template(prompt_template: str) -> str:
    """A Jinja chat template under which ``apply_chat_template([{"role": "user", "content": q}])``
    is ``prompt_template.format(question=q)`` (the prompt the policy was trained on). Each user
    message is rendered through the template, each assistant message is its content + EOS; other
    roles are dropped; ``add_generation_prompt`` adds nothing (the template ends where the answer
    starts). Literal text is written as JSON string literals (Jinja reads their escapes)."""
    parts = []
    for literal, field, _, _ in string.Formatter().parse(prompt_template):
        if literal:
            parts.append("{{ " + json.dumps(literal) + " }}")
        if field is not None:  # ModelSection allows only {question}
            parts.append("{{ message['content'] }}")
    user = "".join(parts)
    return ("{% for message in messages %}{% if message['role'] == 'user' %}" + user +
            "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
            "{% endif %}{% endfor %}")


@contextlib.contextmanager
def _staging(out_dir: Path) -> Iterator[Path]:
    """A temporary sibling of ``out_dir``; on a clean exit its files are fsynced and it replaces
    ``out_dir`` (an existing one is moved aside first and removed after), else it is removed."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    old = None
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp made it private; an export is an ordinary directory
        for f in [*tmp.iterdir(), *(g for d in tmp.iterdir() if d.is_dir() for g in d.iterdir())]:
            os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~umask)  # subdirectories: the LoRA adapter
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if out_dir.exists() and any(out_dir.iterdir()):
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)  # onto a missing or empty directory
    finally:
        for d in (tmp, old):
            if d is not None and d.exists():
                shutil.rmtree(d, ignore_errors=True)
