"""Build the policy (model + tokenizer) a run trains: a HF checkpoint or the tiny demo model.

One code path serves the CPU demo and real checkpoints: both end as a ``Decoder`` plus a
``Tokenizer`` read from a ``tokenizer.json``. Parameters are always float32 master weights
(``optim.PARAM_DTYPE``); ``model.dtype`` is the compute dtype the layers cast them to, and the
rollout engine gets a copy in ``rollout.dtype`` (``rollout_dtype``: ``model.dtype`` unless set;
``compute_params``). The demo's tokenizer is trained with the
``tokenizers`` library on the task corpus and saved in the run directory, so a resumed run or an
evaluation reads the very same file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from flax import nnx

from rhyme_jax.config import RunConfig
from rhyme_jax.data import Problem
from rhyme_jax.data.synthetic import corpus
from rhyme_jax.model import chat_template, hub
from rhyme_jax.model.chat_template import ChatTemplate
from rhyme_jax.model.config import ModelConfig
from rhyme_jax.model.loader import load_hf_checkpoint
from rhyme_jax.model.precision import DTYPES, cast_floating
from rhyme_jax.model.tokenizer import Tokenizer, train_demo_tokenizer
from rhyme_jax.model.transformer import Decoder
from rhyme_jax.parallel.mesh import train_mesh
from rhyme_jax.parallel.reshard import create_sharded
from rhyme_jax.train.optim import PARAM_DTYPE


class PolicyConfigError(ValueError):
    """The model section of the config cannot be satisfied (names the field)."""


def compute_dtype(name: str):
    """Map ``model.dtype`` (the compute dtype; parameters stay ``PARAM_DTYPE``) to a jnp dtype.

    Raises:
      PolicyConfigError: unknown dtype name.
    """
    try:
        return DTYPES[name]
    except KeyError:
        raise PolicyConfigError(f"model.dtype={name!r}: expected one of {sorted(DTYPES)}") from None


def rollout_dtype(cfg: RunConfig):
    """The jnp dtype the run's rollout engines compute in and hold their weights and KV pages in:
    ``rollout.dtype``, or ``model.dtype`` when that is ``""``.

    Raises:
      PolicyConfigError: unknown dtype name.
    """
    return compute_dtype(cfg.rollout.dtype or cfg.model.dtype)


def compute_params(state: Any, dtype) -> Any:
    """``state`` with every floating-point leaf cast to the compute dtype ``dtype``: the copy of
    the float32 master weights a rollout engine or evaluation runs on (each layer would cast them
    anyway; a bf16 copy halves the weights a rollout worker holds). Leaves already in ``dtype``
    and integer leaves are returned as they are (no copy). Each cast keeps its leaf's sharding.

    Args:
      state: a params pytree (``nnx.State``), e.g. f32 leaves in the train layout.
      dtype: compute dtype (``compute_dtype(cfg.model.dtype)``).

    Returns:
      The same structure with floating leaves in ``dtype``.

    Mixed precision as in Micikevicius et al. 2018 (arXiv 1710.03740): float32 master weights,
    low-precision copies for the forward pass.
    """
    return cast_floating(state, dtype)


def tokenizer_file(cfg: RunConfig, run_dir: Path) -> Path:
    """Where this run's tokenizer.json lives (config override, checkpoint dir, or run dir)."""
    if cfg.model.tokenizer_path:
        return Path(cfg.model.tokenizer_path)
    if cfg.model.path:
        return hub.resolve(cfg.model.path) / "tokenizer.json"
    return run_dir / "tokenizer.json"


def build_tokenizer(cfg: RunConfig, run_dir: Path, train_problems: Sequence[Problem]) -> Tokenizer:
    """Load the run's tokenizer, training the demo tokenizer on first use.

    For the tiny demo model (``model.path == ""``) the tokenizer is trained on the train split's
    questions and solutions (and the prompt template's text where it has characters they lack, so
    every prompt encodes) and written to ``run_dir/tokenizer.json`` (or ``model.tokenizer_path``).

    The prompt format is ``model.chat_template`` (``select_chat_template``) set on the tokenizer
    (``Tokenizer.use_chat_template``): its ``format_prompt`` renders every prompt of the run.

    Raises:
      PolicyConfigError: a real checkpoint directory has no tokenizer.json.
      ChatTemplateError: ``model.chat_template`` asks for a template the tokenizer lacks, or its
        file is not a valid template (the message starts with the key).
    """
    if cfg.model.path:
        hub.ensure(cfg.model.path)  # a known model named in the config is imported on first use
    path = tokenizer_file(cfg, run_dir)
    chat = select_chat_template(cfg, path.parent)
    if path.is_file():
        return Tokenizer.from_file(path).use_chat_template(chat, cfg.model.system_prompt)
    if cfg.model.path or cfg.model.tokenizer_path:
        raise PolicyConfigError(f"model.tokenizer_path: no tokenizer file at {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    texts = corpus(train_problems)
    template = (chat.prompt("", cfg.model.system_prompt) if chat is not None
                else cfg.model.prompt_template.format(question=""))
    if not set(template) <= set("".join(texts)):  # the template's own characters (e.g. its newline)
        texts.append(template)
    tok = train_demo_tokenizer(texts, cfg.data.tokenizer_vocab_size, path)
    return tok.use_chat_template(chat, cfg.model.system_prompt)


def select_chat_template(cfg: RunConfig, tokenizer_dir: Path) -> ChatTemplate | None:
    """The chat template ``model.chat_template`` selects for the tokenizer in ``tokenizer_dir``
    (``model.chat_template.select``); ``None`` = ``model.prompt_template``.

    Raises:
      ChatTemplateError: ``tokenizer`` and the tokenizer has none, or the file fails to load.
    """
    return chat_template.select(cfg.model.chat_template, tokenizer_dir)


def tiny_model_config(cfg: RunConfig, tokenizer: Tokenizer) -> ModelConfig:
    """ModelConfig of the demo model: shape from ``model.tiny``, vocabulary from the tokenizer."""
    t = cfg.model.tiny
    return ModelConfig(
        family=t.family,
        vocab_size=tokenizer.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_layers=t.num_layers,
        num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads,
        head_dim=t.head_dim,
        rope_theta=t.rope_theta,
        tie_word_embeddings=t.tie_word_embeddings,
        qk_norm=t.family == "qwen3",
        attention_bias=t.family == "qwen2",
        max_position_embeddings=t.max_position_embeddings,
        eos_token_ids=(tokenizer.eos_id,),
    )


def build_model(cfg: RunConfig, tokenizer: Tokenizer, seed: int) -> Decoder:
    """The policy: loaded from ``model.path`` or freshly initialised from ``model.tiny``, with
    float32 parameters (``PARAM_DTYPE``; a bf16 checkpoint is widened exactly) computing in
    ``model.dtype``."""
    dtype = compute_dtype(cfg.model.dtype)
    if cfg.model.path:
        _, model = load_hf_checkpoint(hub.ensure(cfg.model.path), dtype=dtype, param_dtype=PARAM_DTYPE)
        for name, value in cfg.model.decoder_options().items():
            setattr(model, name, value)
        return model
    # The same jitted initialisation as build_sharded on one device, so both give equal values.
    model_cfg = tiny_model_config(cfg, tokenizer)
    graphdef, state, _ = create_sharded(
        lambda: Decoder(model_cfg, dtype=dtype, param_dtype=PARAM_DTYPE, rngs=nnx.Rngs(seed),
                        **cfg.model.decoder_options()), train_mesh(1, 1, 1))
    return nnx.merge(graphdef, state)


def build_sharded(cfg: RunConfig, tokenizer: Tokenizer, seed: int, mesh) -> tuple[nnx.GraphDef, nnx.State, ModelConfig]:
    """The policy created directly in its shardings on ``mesh`` (``parallel.rules``).

    A HF checkpoint is read block by block into each device's shard; the tiny model is
    initialised under jit with sharded outputs (``parallel.reshard.create_sharded``). Values
    equal ``build_model``'s on any mesh; parameters are float32 (``PARAM_DTYPE``) master weights,
    the graph computes in ``model.dtype``. Returns ``(graphdef, state, model_cfg)``.
    """
    dtype = compute_dtype(cfg.model.dtype)
    if cfg.model.path:
        model_cfg, model = load_hf_checkpoint(hub.ensure(cfg.model.path), dtype=dtype, param_dtype=PARAM_DTYPE,
                                              mesh=mesh)
        for name, value in cfg.model.decoder_options().items():
            setattr(model, name, value)
        graphdef, state = nnx.split(model)
        return graphdef, state, model_cfg
    model_cfg = tiny_model_config(cfg, tokenizer)
    graphdef, state, _ = create_sharded(
        lambda: Decoder(model_cfg, dtype=dtype, param_dtype=PARAM_DTYPE, rngs=nnx.Rngs(seed),
                        **cfg.model.decoder_options()), mesh)
    return graphdef, state, model_cfg


def eos_ids(model: Decoder | ModelConfig, tokenizer: Tokenizer) -> tuple[int, ...]:
    """Token ids that end a response: the tokenizer's EOS plus the checkpoint's own
    (``model`` is the ``Decoder`` or its ``ModelConfig``)."""
    model_cfg = model.cfg if isinstance(model, Decoder) else model
    ids = {int(tokenizer.eos_id)} | {int(i) for i in model_cfg.eos_token_ids}
    return tuple(sorted(ids))
