"""Cost of one rollout forward pass: plain decode vs HistoSpec verify (issue 4).

HistoSpec's rollout speed-up is ``(fewer batch passes) x (plain pass cost / verify pass cost)``.
``benchmarks.rollout`` measures the first factor on real rollouts; ``pass_costs`` the second: the
rollout engine's jitted step (``PassRunner.run``: host inputs -> forward -> sampling / lossless
verification -> tokens back on the host) for ``rows`` live sequences of ``context`` cached tokens
each (distinct pages per sequence, as in a rollout), with K draft tokens per row for each K
(K = 0 is plain decode). Weights are random (the cost does not depend on them). Per K: the median
wall-clock milliseconds per pass after a warm-up, tokens per pass, compile seconds and the cost
relative to the first K. ``bucket_costs`` times given ``(rows, tokens)`` programs instead (issue
50: SmolLM2's verify programs at 2.6-3.7x decode on an H200). ``python -m benchmarks.pass_cost`` is
the command line.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rhyme_lab.measure.timing import median_seconds, seconds_of
from rhyme_jax.model.config import ModelConfig
from rhyme_jax.rollout import batching

# The CPU demo's model (configs/default.yaml model.tiny) with the demo tokenizer's vocabulary.
DEMO = ModelConfig(family="qwen3", vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=4,
                   num_heads=4, num_kv_heads=2, head_dim=32)


def model_config(name: str) -> ModelConfig:
    """``"demo"`` (``DEMO``) or a directory holding a HF ``config.json`` (architecture only)."""
    return DEMO if name == "demo" else ModelConfig.from_hf_dir(name)


def pass_inputs(eng, rows: int, context: int, k, rng: np.random.Generator):
    """Verify inputs of ``rows`` sequences with ``context`` cached tokens and ``k`` drafts each
    (an int, or ``int[rows]`` draft lengths), every sequence on its own pages (the pool is filled
    by ``eng.allocator``; ``eng``: a ``RolloutEngine``). Returns ``(inputs, tokens)``:
    ``batching.verify_inputs`` of the step bucket the engine would pick and its packed-token
    count."""
    alloc = eng.allocator
    lens = np.broadcast_to(np.asarray(k, np.int64), (rows,))
    k_max = int(lens.max(initial=0))
    for s in range(rows):
        if alloc.num_held[s] == 0:
            alloc.ensure(s, context + 1 + k_max)
    ids = np.arange(rows)
    slot_len = np.full(eng.max_slots, context, np.int64)
    slot_last = rng.integers(0, eng.model_cfg.vocab_size, eng.max_slots).astype(np.int32)
    drafts = rng.integers(0, eng.model_cfg.vocab_size, (rows, k_max)).astype(np.int32)
    n_rows = eng.plan.bucket(rows)
    t, q = eng.plan.pass_pair(n_rows, int(rows + lens.sum()))  # the bucket the engine would pick
    width = eng.plan.width(int(alloc.num_held[ids].max()))
    return batching.verify_inputs(ids, slot_len, slot_last, drafts, np.minimum(lens, q - 1), alloc.page_table,
                                  eng.page_size, n_rows, t, q, width), t


def bucket_drafts(eng, rows: int, tokens: int) -> np.ndarray:
    """Draft lengths ``int[rows]`` that pack exactly ``tokens`` tokens in ``rows`` rows (each row's
    pending token plus its drafts, spread evenly), for the engine's ``(rows, tokens)`` program.

    Raises:
      ValueError: ``(rows, tokens)`` is not one of the engine's decode/verify programs (the
        message lists them).
    """
    pairs = {(s.rows, s.tokens): s.q_len for s in eng.programs(spec=True) if s.kind != "prefill"}
    if (rows, tokens) not in pairs:
        raise ValueError(f"--buckets: ({rows}, {tokens}) is not a decode/verify program of this engine; "
                         f"(rows, tokens) programs: {sorted(pairs)}")
    extra = tokens - rows
    lens = np.full(rows, extra // rows, np.int64) + (np.arange(rows) < extra % rows)
    assert lens.max(initial=0) <= pairs[rows, tokens] - 1, (rows, tokens, pairs[rows, tokens])
    return lens


def parse_buckets(text: str) -> list[tuple[int, int]]:
    """``"4x4,4x6"`` -> ``[(4, 4), (4, 6)]``: (rows, packed tokens) programs to time.

    Raises:
      ValueError: not comma-separated ``ROWSxTOKENS`` pairs with ``1 <= rows <= tokens``.
    """
    try:
        out = [tuple(int(v) for v in x.split("x")) for x in text.split(",")]
    except ValueError:
        out = []
    if not out or any(len(p) != 2 or not 1 <= p[0] <= p[1] for p in out):
        raise ValueError(f"--buckets: ROWSxTOKENS pairs with 1 <= rows <= tokens, got {text}")
    return out


def parse_drafts(text: str) -> list[int]:
    """``"0,1,3"`` -> ``[0, 1, 3]``: draft tokens per row of each pass to time.

    Raises:
      ValueError: not comma-separated integers in ``[0, MAX_DRAFT]`` (the message names them).
    """
    try:
        ks = [int(x) for x in text.split(",")]
    except ValueError:
        ks = []
    if not ks or min(ks) < 0 or max(ks) > batching.MAX_DRAFT:
        raise ValueError(f"--drafts: values in [0, {batching.MAX_DRAFT}], got {text}")
    return ks


def pass_engine(cfg: ModelConfig, dtype: str, rows: int, context: int, max_k: int, attention: str = "auto",
                *, max_new_tokens: int = 0, verify_tokens: int = 0, row_buckets: tuple[int, ...] = ()):
    """A ``RolloutEngine`` of ``rows`` slots for passes of up to ``max_k`` drafts per row, and
    random (seed 0) ``dtype`` weights of ``cfg`` on one device: ``(engine, state)``.
    ``max_new_tokens`` (default ``max_k + 2``) sizes the pool with the prompt length
    ``context``; ``verify_tokens`` is the verify budget (default ``rows * (max_k + 1)``);
    ``row_buckets``: extra row buckets (``rollout.row_buckets``)."""
    from rhyme_jax.config import RolloutSection
    from rhyme_jax.model.transformer import Decoder
    from rhyme_jax.parallel.mesh import train_mesh
    from rhyme_jax.parallel.reshard import create_sharded
    from rhyme_jax.rollout.engine import EngineConfig, RolloutEngine

    dt = jnp.dtype(dtype)
    graphdef, state, _ = create_sharded(lambda: Decoder(cfg, dtype=dt, param_dtype=dt, rngs=nnx.Rngs(0)),
                                        train_mesh(1, 1, 1))
    eng = RolloutEngine(graphdef, cfg, EngineConfig(
        max_slots=rows, page_size=RolloutSection.page_size, num_pages=0, max_prompt_len=context,
        max_new_tokens=max(max_new_tokens, max_k + 2), eos_ids=[], attention_impl=attention,
        max_verify_tokens=verify_tokens or rows * (max_k + 1), row_buckets=row_buckets))
    return eng, state


def pass_costs(eng, state, ks: list[int], rows: int, context: int, iters: int, temperature: float = 1.0,
               log=print) -> list[dict]:
    """Time the engine's pass for each K of ``ks`` (``pass_inputs``, seed 0): the first run is
    the compile (``compile_s``), 3 untimed runs, then the median of ``iters`` (``ms``).

    Returns one dict per K: ``k``, ``tokens`` (packed tokens per pass), ``ms``, ``compile_s`` and
    ``relative`` (``ms`` / the first K's). ``log``: a line per K (``None``: quiet).
    """
    from rhyme_jax.rollout.engine import SamplingParams

    runner = eng.runner(state, SamplingParams(temperature=temperature, max_new_tokens=max(ks) + 2))
    rng = np.random.default_rng(0)
    results = []
    for k in ks:
        inp, t = pass_inputs(eng, rows, context, k, rng)
        compile_s = seconds_of(lambda: runner.run(inp), 1)[0]
        ms = 1e3 * median_seconds(lambda: runner.run(inp), iters, warmup=3)  # ends with the tokens on the host
        results.append(dict(k=k, tokens=t, ms=ms, compile_s=compile_s))
        if log:
            log(f"K={k:2d}: {t} tokens/pass, {ms:.3f} ms/pass (compile {compile_s:.1f} s)")
    for r in results:
        r["relative"] = r["ms"] / results[0]["ms"]
    return results


def bucket_costs(eng, state, buckets: list[tuple[int, int]], context: int, iters: int, temperature: float = 1.0,
                 log=print, memory: bool = False) -> list[dict]:
    """Time the engine's ``(rows, tokens)`` programs (``bucket_drafts``: drafts that fill each
    exactly; ``pass_inputs``, seed 0) like ``pass_costs``. With ``memory`` each program is also
    compiled ahead of time for ``compiled.memory_analysis()``: ``temp_mb``, its temporaries, against
    ``pool_mb``, the KV pool (a program that copies the pool shows ``temp_mb >= pool_mb / L``).

    Returns one dict per bucket: ``rows``, ``tokens``, ``q_len``, ``ms``, ``compile_s``,
    ``relative`` (``ms`` / the decode program of the same rows when timed, else 1), and with
    ``memory`` ``temp_mb`` and ``pool_mb``.

    Raises:
      ValueError: a bucket that is not one of the engine's programs (``bucket_drafts``).
    """
    from rhyme_jax.rollout.engine import SamplingParams

    lens = [bucket_drafts(eng, r, t) for r, t in buckets]  # every bucket checked before any compile
    runner = eng.runner(state, SamplingParams(temperature=temperature,
                                              max_new_tokens=int(max(x.max() for x in lens)) + 2))
    rng = np.random.default_rng(0)
    results = []
    for (rows, tokens), k in zip(buckets, lens):
        inp, t = pass_inputs(eng, rows, context, k, rng)
        assert t == tokens, (rows, tokens, t)
        compile_s = seconds_of(lambda: runner.run(inp), 1)[0]
        ms = 1e3 * median_seconds(lambda: runner.run(inp), iters, warmup=3)
        r = dict(rows=rows, tokens=t, q_len=int(inp.max_q_len), ms=ms, compile_s=compile_s)
        if memory:
            temp = runner.lower(inp).compile().memory_analysis().temp_size_in_bytes
            r.update(temp_mb=temp / 2 ** 20, pool_mb=eng.kv.nbytes / 2 ** 20)
        results.append(r)
        if log:
            log(f"rows={rows} tokens={t} q_len={r['q_len']}: {ms:.3f} ms/pass (compile {compile_s:.1f} s)"
                + (f", temporaries {r['temp_mb']:.1f} MiB (pool {r['pool_mb']:.1f} MiB)" if memory else ""))
    decode = {r["rows"]: r["ms"] for r in results if r["q_len"] == 1}
    for r in results:
        r["relative"] = r["ms"] / decode.get(r["rows"], r["ms"])
    return results


def bucket_table(meta: dict, results: list[dict]) -> str:
    """Markdown report of ``bucket_costs``: ``meta`` on the first line, one row per program."""
    mem = "temp_mb" in results[0] if results else False
    lines = [f"{meta}", "", "| rows | tokens | q_len | ms/pass | vs decode (same rows) |"
             + (" temporaries MiB | pool MiB |" if mem else ""), "|---|---|---|---|---|" + ("---|---|" if mem else "")]
    for r in results:
        lines.append(f"| {r['rows']} | {r['tokens']} | {r['q_len']} | {r['ms']:.3f} | {r['relative']:.2f}x |"
                     + (f" {r['temp_mb']:.1f} | {r['pool_mb']:.1f} |" if mem else ""))
    return "\n".join(lines)


def cost_table(meta: dict, results: list[dict], passes_ratio: float = 0.0) -> str:
    """Markdown report of ``pass_costs``: ``meta`` on the first line, one row per K; with
    ``passes_ratio`` (fewer batch passes from ``benchmarks.rollout``) the implied speed-up."""
    extra = passes_ratio > 0
    lines = [f"{meta}", "", "| K drafts/row | tokens/pass | ms/pass | vs plain decode |"
             + (" implied speed-up |" if extra else ""), "|---|---|---|---|" + ("---|" if extra else "")]
    for r in results:
        lines.append(f"| {r['k']} | {r['tokens']} | {r['ms']:.3f} | {r['relative']:.2f}x |"
                     + (f" {passes_ratio / r['relative']:.2f}x |" if extra else ""))
    return "\n".join(lines)


def run_meta(model: str, dtype: str, rows: int, context: int, eng, state) -> dict:
    """What a pass-cost report was measured on: model, dtype, sizes, device, backend, jax
    version, attention implementation and parameter count."""
    dev = jax.devices()[0]
    return dict(model=model, dtype=dtype, rows=rows, context=context, device=dev.device_kind,
                backend=jax.default_backend(), jax=jax.__version__, attention=eng.attention_impl,
                params=int(sum(x.size for x in jax.tree.leaves(state))))


def write_cost_report(out, model: str, meta: dict, results: list[dict], table: str) -> Path:
    """Write ``pass_cost_<model name>.md`` (``table``) and ``.json`` (``meta``, ``results``)
    under the folder ``out`` (made if missing); returns the JSON's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "pass_cost_" + Path(model).name
    (out / f"{stem}.md").write_text(table + "\n")
    path = out / f"{stem}.json"
    path.write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    return path
