"""Host time per decode pass: the per-pass engine against chunked engines (issue 50).

Each engine (``rollout.passes_per_dispatch`` = 1, and each chunk size asked for) generates the
same prompts with the same key and random weights, in alternating rounds after an untimed
compile round. From each ``generate``'s ``RolloutResult.stats``:

* ``device_ms_per_pass``: ``device_wait_seconds / decode_steps``: the host's time blocked fetching
  pass outputs after their dispatch (device time plus the transfer; prefill included), per
  decode pass;
* ``host_ms_per_pass``: ``(seconds - device_wait_seconds) / decode_steps``: everything else the
  call spent (packing inputs, dispatch, recording tokens, pages, admission, drafting);
* ``tokens_per_s`` and ``bound_tokens_per_s = generated_tokens / device_wait_seconds`` (the rate
  with no host time: the device-only bound), ``of_bound`` their ratio;
* ``drafting_share``: ``drafting_seconds / seconds``.

Figures are medians over the rounds. The rollout weights (the engine's dtype cast and per-layer
split, ``rollout/run_weights.py``) are made once per weight version, so after the compile round
the calls reuse them; ``weights_ms`` is what making them costs (paid once per RL step, for every
``generate`` of that step), timed apart on a fresh copy of the weights. ``same_tokens`` says whether every engine emitted the
per-pass engine's tokens. With HistoSpec (``histospec_drafter``) every engine also drafts: the
per-pass engine on the host before each pass, the chunked ones on the device inside each chunk
(``rollout/chunk_spec.py``); ``accepted_per_pass`` and ``drafted_tokens`` then say how much the
drafts carried. ``python -m benchmarks.pass_overhead`` is the command line.
"""

from __future__ import annotations

import statistics

import numpy as np

from rhyme_jax.model.config import ModelConfig

FIELDS = ("host_ms_per_pass", "device_ms_per_pass", "tokens_per_s", "bound_tokens_per_s", "of_bound",
          "drafting_share", "decode_steps", "decode_dispatches", "generated_tokens", "drafted_tokens",
          "accepted_tokens")


def engines(cfg: ModelConfig, dtype: str, slots: int, prompt_len: int, new_tokens: int, chunks: list[int],
            eos_ids=(), attention: str = "auto", layer_weights: str = "auto"):
    """``({passes_per_dispatch: RolloutEngine}, state)``: one engine of ``slots`` slots per chunk
    size (1 = the per-pass engine) over random (seed 0) ``dtype`` weights of ``cfg``
    (``layer_weights``: ``EngineConfig.layer_weights``)."""
    import jax.numpy as jnp
    from flax import nnx

    from rhyme_jax.model.transformer import Decoder
    from rhyme_jax.parallel.mesh import train_mesh
    from rhyme_jax.parallel.reshard import create_sharded
    from rhyme_jax.rollout.engine import EngineConfig, RolloutEngine

    dt = jnp.dtype(dtype)
    graphdef, state, _ = create_sharded(lambda: Decoder(cfg, dtype=dt, param_dtype=dt, rngs=nnx.Rngs(0)),
                                        train_mesh(1, 1, 1))
    out = {n: RolloutEngine(graphdef, cfg, EngineConfig(
        max_slots=slots, page_size=16, max_prompt_len=prompt_len, max_new_tokens=new_tokens, eos_ids=tuple(eos_ids),
        attention_impl=attention, passes_per_dispatch=n, layer_weights=layer_weights)) for n in sorted({1, *chunks})}
    return out, state


def prompts(n: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` random prompts of ``prompt_len / 2 .. prompt_len`` tokens."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(max(1, prompt_len // 2), prompt_len + 1))).tolist()
            for _ in range(n)]


def figures(stats: dict) -> dict:
    """The ``FIELDS`` of one ``generate``'s stats (module docstring)."""
    steps = max(int(stats["decode_steps"]), 1)
    wait, secs = float(stats["device_wait_seconds"]), float(stats["seconds"])
    bound = stats["generated_tokens"] / max(wait, 1e-12)
    return dict(host_ms_per_pass=1e3 * (secs - wait) / steps, device_ms_per_pass=1e3 * wait / steps,
                tokens_per_s=float(stats["tokens_per_s"]), bound_tokens_per_s=bound,
                of_bound=float(stats["tokens_per_s"]) / bound, drafting_share=stats["drafting_seconds"] / secs,
                decode_steps=int(stats["decode_steps"]), decode_dispatches=int(stats["decode_dispatches"]),
                generated_tokens=int(stats["generated_tokens"]), drafted_tokens=int(stats.get("drafted_tokens", 0)),
                accepted_tokens=int(stats.get("accepted_tokens", 0)))


def histospec_drafter(engine, state, batch: list[list[int]], group: int, sampling, history_key: int = 1):
    """``(store, make)``: a HistoSpec drafter's history from one per-pass rollout of ``batch``
    with key ``history_key`` (the previous epoch's rollout of the same prompts; requests
    ``group`` at a time share a prompt id), and ``make()`` -> a fresh ``DraftBatch`` (goodput
    window, self-lookup and siblings, pattern 1..7, the engine's pass-cost model) per call."""
    import jax
    from types import SimpleNamespace

    from rhyme_jax.spec.drafter import Drafter
    from rhyme_jax.spec.history import HistoryStore

    pids = np.arange(len(batch)) // max(1, group)
    prev = engine.generate(state, batch, sampling, jax.random.key(history_key))
    store = HistoryStore()
    store.update(0, pids, [np.asarray(p) for p in batch], prev.tokens, np.zeros(len(batch)))
    cfg = SimpleNamespace(enabled=True, branch="reward", window="goodput", fixed_window=8, min_token_prob=0.0,
                          pattern_max=7, pattern_min=1, history_depth=1, self_lookup=True, siblings=True,
                          step_cost="prior")
    drafter = Drafter(cfg, store)
    drafter.rebuild(pids)
    return drafter, lambda: drafter.batch(pids)


def measure(engs: dict, state, batch: list[list[int]], sampling, rounds: int, log=print, drafter=None,
            warmup: bool = True) -> dict:
    """Alternate ``rounds`` timed ``generate`` calls of every engine (after one untimed compile
    round; key 0 each time; ``drafter()``, when given, makes each call's drafter, and with
    ``warmup`` every program of the engines is compiled first, since drafts pick among many).
    Returns ``{"engines": {n: medians of FIELDS}, "same_tokens": bool}``."""
    import jax

    key = jax.random.key(0)
    make = drafter or (lambda: None)
    if drafter is not None and warmup:  # drafts pick among many programs: compile them all before timing
        for e in engs.values():
            e.warmup(state, sampling, spec=True)
    first = {n: e.generate(state, batch, sampling, key, drafter=make()) for n, e in engs.items()}  # compiles
    base = first[1].tokens
    same = all(all(np.array_equal(a, b) for a, b in zip(base, r.tokens)) for r in first.values())
    runs: dict = {n: [] for n in engs}
    for r in range(rounds):
        for n, e in engs.items():
            f = figures(e.generate(state, batch, sampling, key, drafter=make()).stats)
            runs[n].append(f)
            if log:
                log(f"round {r} N={n}: host {f['host_ms_per_pass']:.3f} ms/pass, device "
                    f"{f['device_ms_per_pass']:.3f} ms/pass, {f['tokens_per_s']:.0f} tok/s ({f['of_bound']:.1%} of bound)")
    med = {n: {k: float(statistics.median(f[k] for f in fs)) for k in FIELDS} for n, fs in runs.items()}
    return {"engines": med, "same_tokens": bool(same), "weights_ms": weights_ms(engs[1], state)}


def weights_ms(engine, state, reps: int = 3) -> float:
    """Median ms to make ``engine``'s rollout weights from a new weight version of ``state``
    (``run_weights.rollout_weights`` into an empty cache; 0 where nothing is copied)."""
    import time

    import jax

    from rhyme_jax.rollout.run_weights import WeightCache, rollout_weights

    times = []
    for _ in range(reps):
        fresh = jax.block_until_ready(jax.tree.map(lambda x: x + 0, state))
        t0 = time.perf_counter()
        jax.block_until_ready(rollout_weights(fresh, engine.dtype, engine.config.layer_weights, WeightCache()))
        times.append(1e3 * (time.perf_counter() - t0))
    return float(statistics.median(times))


def table(meta: dict, result: dict) -> str:
    """Markdown table of ``measure``'s result, one row per engine, ``meta`` on the first line."""
    lines = [f"{meta}", "", f"same tokens as the per-pass engine: {result['same_tokens']}", "",
             f"rollout weights (cast/split) made once per weight version: {result.get('weights_ms', 0.0):.1f} ms", "",
             "| passes/dispatch | host ms/pass | device ms/pass | tokens/s | device-only bound | of bound | "
             "drafting share | passes | dispatches | drafted | accepted |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, f in sorted(result["engines"].items()):
        lines.append(f"| {n} | {f['host_ms_per_pass']:.3f} | {f['device_ms_per_pass']:.3f} | {f['tokens_per_s']:.0f} | "
                     f"{f['bound_tokens_per_s']:.0f} | {f['of_bound']:.1%} | {f['drafting_share']:.1%} | "
                     f"{f['decode_steps']:.0f} | {f['decode_dispatches']:.0f} | {f.get('drafted_tokens', 0):.0f} | "
                     f"{f.get('accepted_tokens', 0):.0f} |")
    return "\n".join(lines) + "\n"
