"""Tunix sampler worker for ``python -m benchmarks.peers``: runs in Tunix's own venv (``.venv-tunix``) as
``python -m benchmarks.peer_tunix_worker`` from the repository root; never imports rhyme_jax.

Reads one JSON request on stdin (``model_dir``, ``prompt_ids`` (one list of token ids per row),
``batch``, ``max_new_tokens``, ``temperatures``, ``seed``, ``eos_id``, ``check``) and prints one JSON
line on stdout: per temperature tokens/s and response lengths, or ``status: "failed"`` with the error.

The model is Tunix's ``tunix.models.llama3`` (``Llama3``) built from the checkpoint's ``config.json``
(SmolLM2 has no ready config: hidden 576, 9 / 3 heads, head_dim 64, 30 layers, tied embeddings)
and loaded with ``llama3.params.create_model_from_safe_tensors``; sampling is
``tunix.generate.sampler.Sampler`` (``temperature``, ``top_p=1.0``, ``top_k=None``: full-vocabulary
categorical sampling; ``max_generation_steps``; KV cache of ``CacheConfig.cache_size`` positions).
Tunix 0.1.7's Llama3 attention calls ``apply_rope`` without the config's ``rope_theta`` (so every
model gets theta 1e6); this worker binds the checkpoint's theta (SmolLM2: 1e5), and ``check``
reports next-token log-probabilities of the first prompt with and without that fix, for
``benchmarks.peers`` to compare against transformers.

The prompts arrive as token ids; a small tokenizer object hands them to the ``Sampler`` unchanged
(no BOS added) and pads with id 0 (``<|endoftext|>``, absent from the prompts; the EOS id 2 occurs
inside the chat template, so it cannot be the pad, which Tunix's sampler masks out).
"""

from __future__ import annotations

import functools
import json
import sys
import time
import traceback
from importlib import metadata


class IdsTokenizer:
    """The tokenizer interface Tunix's ``TokenizerAdapter`` accepts; ``encode`` maps a row key to its ids."""

    def __init__(self, table: dict[str, list[int]], tokenizer_json: str, eos_id: int, pad_id: int = 0):
        from tokenizers import Tokenizer

        self.table, self._tok, self._eos, self._pad = table, Tokenizer.from_file(tokenizer_json), eos_id, pad_id

    def encode(self, text, **kwargs):
        return list(self.table[text])

    def decode(self, ids, **kwargs):
        return self._tok.decode(list(ids))

    def bos_id(self):
        return None

    def eos_id(self):
        return self._eos

    def pad_id(self):
        return self._pad


def model_config(model_dir: str):
    """Tunix ``Llama3`` config from the Hugging Face ``config.json``."""
    import os

    from tunix.models.llama3 import model as model_lib

    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    theta = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
    return model_lib.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"],
        head_dim=hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"]),
        num_kv_heads=hf["num_key_value_heads"], rope_theta=theta, norm_eps=hf["rms_norm_eps"],
        weight_tying=bool(hf.get("tie_word_embeddings", False)))


def next_token_logprobs(model, ids: list[int], k: int = 20) -> dict:
    """Top-``k`` next-token log-probabilities after ``ids`` (one full forward, no cache)."""
    import jax
    import jax.numpy as jnp

    n = len(ids)
    tokens = jnp.asarray([ids], jnp.int32)
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    mask = jnp.tril(jnp.ones((n, n), bool))[None]
    logits, _ = model(tokens, pos, None, mask)
    lp = jax.nn.log_softmax(logits[0, -1].astype(jnp.float32))
    top = jnp.argsort(-lp)[:k]
    return dict(ids=[int(i) for i in top], logprobs=[float(lp[i]) for i in top])


def rope_check(model_lib, model, cfg, ids) -> dict:
    """Next-token log-probabilities with the checkpoint's rope theta and with Tunix's own call."""
    fixed = next_token_logprobs(model, ids)
    patched = model_lib.apply_rope
    model_lib.apply_rope = patched.func  # Tunix 0.1.7 as shipped: theta 1e6 whatever the config says
    try:
        unfixed = next_token_logprobs(model, ids)
    finally:
        model_lib.apply_rope = patched
    return dict(rope_theta_bound=cfg.rope_theta, fixed=fixed, as_shipped=unfixed)


def lengths_of(tokens, eos_id: int, limit: int) -> list[int]:
    """Sampler output rows are cut before the first EOS: count the EOS back in (rows at ``limit``
    tokens had none)."""
    out = []
    for t in tokens:
        n = len(t)
        out.append(n if n >= limit else n + 1)
    return out


def measure(sampler, keys, req, max_prompt: int) -> dict:
    """Per temperature: warm-up call on every distinct batch shape, then the timed calls."""
    import numpy as np

    b, new = req["batch"], req["max_new_tokens"]
    batches = [keys[i: i + b] for i in range(0, len(keys), b)]
    out = {}
    for temp in req["temperatures"]:
        def call(rows, seed):
            return sampler(rows, max_generation_steps=new, max_prompt_length=max_prompt, temperature=temp,
                           top_p=1.0, top_k=None, eos_tokens=[req["eos_id"]], seed=seed)

        t0 = time.perf_counter()
        seen = set()
        for rows in batches:  # warm-up: temperature is static in Tunix's sampling state -> one compile each
            if len(rows) not in seen:
                seen.add(len(rows))
                call(rows, req["seed"] + 10_000)
        warm = time.perf_counter() - t0
        lengths, seconds = [], 0.0
        for i, rows in enumerate(batches):
            t0 = time.perf_counter()
            res = call(rows, req["seed"] + i)
            seconds += time.perf_counter() - t0
            lengths += lengths_of(res.tokens, req["eos_id"], new)
        a = np.asarray(lengths, np.float64)
        out[str(temp)] = dict(tokens_per_s=float(a.sum() / seconds), seconds=seconds, warmup_s=warm,
                              generated_tokens=int(a.sum()), lengths_raw=[int(x) for x in lengths])
        print(f"tunix T={temp}: {a.sum() / seconds:.1f} tok/s, {seconds:.1f} s (warm-up {warm:.1f} s)",
              file=sys.stderr, flush=True)
    return out


def run(req: dict) -> dict:
    import os

    import jax
    import jax.numpy as jnp
    from tunix.generate import sampler as sampler_lib
    from tunix.models.llama3 import model as model_lib
    from tunix.models.llama3 import params as params_lib

    cfg = model_config(req["model_dir"])
    model_lib.apply_rope = functools.partial(model_lib.apply_rope, rope_theta=cfg.rope_theta)
    t0 = time.perf_counter()
    model = params_lib.create_model_from_safe_tensors(req["model_dir"], cfg, mesh=None, dtype=jnp.float32)
    load_s = time.perf_counter() - t0
    rows = req["prompt_ids"]
    table = {f"row{i}": ids for i, ids in enumerate(rows)}
    tok = IdsTokenizer(table, os.path.join(req["model_dir"], "tokenizer.json"), req["eos_id"])
    max_prompt = max(len(r) for r in rows)
    cache = max_prompt + req["max_new_tokens"]
    sampler = sampler_lib.Sampler(model, tok, sampler_lib.CacheConfig(
        cache_size=cache, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))
    check = rope_check(model_lib, model, cfg, rows[0]) if req.get("check", True) else None
    temps = measure(sampler, list(table), req, max_prompt)
    versions = {p: metadata.version(p) for p in ("google-tunix", "jax", "jaxlib", "flax")}
    settings = dict(batch=req["batch"], dtype="float32", device=str(jax.devices()[0].platform),
                    cache_size=cache, max_prompt_length=max_prompt, padding="left (pad id 0)",
                    model="tunix.models.llama3.Llama3 (SmolLM2 config, rope_theta bound)",
                    sampling="top_p=1.0, top_k=None (full-vocabulary categorical)")
    return dict(engine="Tunix sampler", status="ok", settings=settings, versions=versions, load_s=load_s,
                check=check, temperatures=temps)


def main() -> None:
    req = json.loads(sys.stdin.read())
    try:
        out = run(req)
    except Exception as exc:  # reported, not raised: peers.py puts the reason in its table
        versions = {}
        for p in ("google-tunix", "jax", "jaxlib", "flax"):
            try:
                versions[p] = metadata.version(p)
            except metadata.PackageNotFoundError:
                versions[p] = None
        out = dict(engine="Tunix sampler", status="failed", error=f"{type(exc).__name__}: {exc}",
                   traceback=traceback.format_exc()[-4000:], versions=versions)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
