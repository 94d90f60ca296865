"""Correctness checks of a ragged paged attention kernel on the real backend
(``python -m benchmarks.kernels --check-only``).

Three groups, each printed as ``PASS``/``FAIL`` lines and written to ``<out>/checks.json``:

1. ``ragged``: the kernel against the reference on random ragged batches
   (``pallas_kernels.ragged_paged_attention.cases.random_case``): q_len 1/3/9/33/64 mixes, GQA 1/4/8, head_dim 64/128,
   f32/bf16, soft cap, sliding window, pages of 16 and 64 tokens, the 8B-class head layout, two
   GPU tilings. The reference runs with ``default_matmul_precision("highest")`` (no TF32), so
   f32 is held to 2e-5 and bf16 to 2e-2 (``cases.TOLERANCE``). GPU kernels run from a
   NaN-poisoned output buffer: a live row the kernel never writes fails the case.
2. ``write_kv``: the GPU ``write_kv`` kernel against ``reference.write_kv`` (GPU kernels only).
3. ``engine``: greedy generation of a tiny random model with the reference and with the kernel
   must emit identical tokens (logprobs within 1e-3); a third run adds an oracle drafter that
   proposes the reference continuation with some tokens corrupted, so verify steps (q_len up to
   9) both accept and reject drafts and must still reproduce the same tokens.

Run it with interpret off on a GPU/TPU; on CPU the default kernel is ``pallas_gpu_interpret``
(slow: use ``--max-cases`` and a small ``--engine-new-tokens`` for a smoke run).
"""

from __future__ import annotations

import functools
import itertools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention import api, pallas_gpu, reference
from pallas_kernels.ragged_paged_attention.cases import TOLERANCE, random_case
from pallas_kernels.ragged_paged_attention.pallas_gpu import GPUBlockSizes

DEFAULT_KERNEL = {"gpu": "pallas_gpu", "tpu": "pallas_tpu", "cpu": "pallas_gpu_interpret"}
ENGINE_LOGPROB_TOL = 1e-3


def ragged_cases() -> list[dict]:
    """The case list: name, random_case kwargs, dtype, soft_cap, sliding_window, GPU tiling."""
    q_mixes = [[1, 3, 9, 33, 64], [64, 33], [1, 1, 1, 9], [9] * 6 + [1] * 6]
    features = [(None, None), (30.0, None), (None, 24), (5.0, 40)]
    cases = []
    for i, (group, hd, dtype) in enumerate(itertools.product([1, 4, 8], [64, 128], [jnp.float32, jnp.bfloat16])):
        kvh = 2 if group < 8 else 1
        cap, win = features[(i // 2) % 4]
        cases.append(dict(q_lens=q_mixes[(i + i // 4) % 4], num_heads=group * kvh, num_kv_heads=kvh, head_dim=hd,
                          page_size=16, pages_per_seq=5, dtype=dtype, soft_cap=cap, sliding_window=win, bs=None))
    eight_b = dict(num_heads=32, num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16, soft_cap=None, sliding_window=None)
    cases += [dict(eight_b, q_lens=[1] * 8 + [9] * 8, page_size=16, pages_per_seq=64, bs=None),
              dict(eight_b, q_lens=[9] * 8 + [1] * 8, page_size=64, pages_per_seq=16, bs=None),
              dict(eight_b, q_lens=[9, 1, 33, 9], page_size=16, pages_per_seq=16,
                   bs=GPUBlockSizes(block_q=64, pages_per_kv_block=2)),
              dict(q_lens=[33, 1, 9], num_heads=8, num_kv_heads=2, head_dim=64, page_size=16, pages_per_seq=5,
                   dtype=jnp.float32, soft_cap=10.0, sliding_window=5,
                   bs=GPUBlockSizes(block_q=32, pages_per_kv_block=1))]
    for c in cases:
        c["name"] = (f"q{'/'.join(map(str, sorted(set(c['q_lens']))))} H{c['num_heads']}/KVH{c['num_kv_heads']} "
                     f"hd{c['head_dim']} ps{c['page_size']} {jnp.dtype(c['dtype']).name}"
                     + (f" cap{c['soft_cap']:g}" if c["soft_cap"] else "")
                     + (f" win{c['sliding_window']}" if c["sliding_window"] else "")
                     + (f" bq{c['bs'].block_q}/ppb{c['bs'].pages_per_kv_block}" if c["bs"] else ""))
    return cases


def check_ragged(kernel: str, case: dict, seed: int) -> dict:
    """One ragged case: kernel vs reference (and unwritten-row poison check for GPU kernels)."""
    rng = np.random.default_rng(seed)
    rc = random_case(rng, case["q_lens"], num_heads=case["num_heads"], num_kv_heads=case["num_kv_heads"],
                     head_dim=case["head_dim"], page_size=case["page_size"], pages_per_seq=case["pages_per_seq"],
                     num_padding_seqs=2)
    args = rc.args(case["dtype"])
    kw = dict(sm_scale=case["head_dim"] ** -0.5, max_q_len=rc.max_q_len, soft_cap=case["soft_cap"],
              sliding_window=case["sliding_window"])
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(jax.jit(functools.partial(reference.ragged_paged_attention, **kw))(*args), np.float32)
    detail = []
    if kernel.startswith("pallas_gpu"):
        fwd = functools.partial(pallas_gpu._forward, **kw, block_sizes=case["bs"],
                                interpret=kernel.endswith("_interpret"), poison_output=True)
        out, blk, blk_ok = jax.jit(fwd)(*args)
        if np.isnan(np.asarray(blk, np.float32)[np.asarray(blk_ok)]).any():
            detail.append("live rows left unwritten (NaN poison survived)")
    else:
        out = jax.jit(functools.partial(api.ragged_paged_attention, **kw, implementation=kernel))(*args)
    out = np.asarray(out, np.float32)
    tol = TOLERANCE[case["dtype"]]
    err = float(np.nanmax(np.abs(out - ref))) if np.isfinite(out).any() else float("nan")
    t_live = int(rc.cu_q_lens[rc.num_seqs[0]])
    if not np.isfinite(out).all():
        detail.append("non-finite output")
    elif not np.allclose(out, ref, atol=tol, rtol=tol):
        detail.append(f"differs from the reference beyond {tol:g}")
    if np.any(out[t_live:] != 0):
        detail.append("padding rows not zero")
    return dict(group="ragged", name=case["name"], max_abs_err=err, status="FAIL" if detail else "PASS",
                detail="; ".join(detail))


def check_write_kv(kernel: str, seed: int = 0) -> dict:
    """GPU ``write_kv`` kernel vs ``reference.write_kv`` on distinct random slots (bf16 pool)."""
    rng = np.random.default_rng(seed)
    kvh, pages, ps, hd, t = 8, 40, 16, 128, 77
    k = jnp.asarray(rng.standard_normal((kvh, pages, ps, hd)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((kvh, pages, ps, hd)), jnp.bfloat16)
    kn = jnp.asarray(rng.standard_normal((t, kvh, hd)), jnp.float32)
    vn = jnp.asarray(rng.standard_normal((t, kvh, hd)), jnp.float32)
    slots = jnp.asarray(rng.choice(np.arange(ps, pages * ps), size=t, replace=False), jnp.int32)
    want = reference.write_kv(k, v, kn, vn, slots)
    got = jax.jit(functools.partial(pallas_gpu.write_kv, interpret=kernel.endswith("_interpret")))(k, v, kn, vn, slots)
    same = all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)) for a, b in zip(got, want))
    return dict(group="write_kv", name=f"write_kv T{t} KVH{kvh} hd{hd} bf16", max_abs_err=0.0 if same else None,
                status="PASS" if same else "FAIL", detail="" if same else "pool differs from reference.write_kv")


class OracleDrafter:
    """Drafts the known greedy continuation (``answers``), one token of every third draft
    replaced, so verification both accepts and rejects. ``pattern_max`` covers a whole sequence,
    so the engine's tails tell how many tokens each request has generated."""

    def __init__(self, prompts, answers, k: int, vocab: int, pattern_max: int):
        self.prompts, self.answers, self.k, self.vocab = prompts, answers, k, vocab
        self.context_width = pattern_max  # tails the engine passes (rollout.types.Drafter)
        self.calls = 0

    def draft(self, reqs, tails, budgets):
        """``(int32[R, k] drafts, int32[R] lengths)``: each request's next known tokens, at most its budget."""
        drafts = np.zeros((len(reqs), self.k), np.int32)
        lens = np.zeros(len(reqs), np.int32)
        for i, r in enumerate(np.asarray(reqs)):
            n_gen = int((tails[i] >= 0).sum()) - len(self.prompts[r])
            d = np.array(self.answers[r][n_gen: n_gen + min(self.k, int(budgets[i]))], np.int32)
            self.calls += 1
            if self.calls % 3 == 0 and d.size > 1:
                d[d.size // 2] = (d[d.size // 2] + 1) % self.vocab
            drafts[i, : d.size], lens[i] = d, d.size
        return drafts, lens

    def observe(self, reqs, drafted, accepted):
        """Nothing to learn: the oracle's drafts do not adapt."""
        pass


def check_engine(kernel: str, new_tokens: int, seed: int = 0) -> list[dict]:
    """Greedy tokens of a tiny random qwen3-style model: reference vs ``kernel`` (plain decode and
    oracle-drafted verify)."""
    from flax import nnx

    from rhyme_jax.model.config import ModelConfig
    from rhyme_jax.model.transformer import Decoder
    from rhyme_jax.rollout.engine import EngineConfig, RolloutEngine, SamplingParams

    cfg = ModelConfig(family="qwen3", vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                      num_heads=8, num_kv_heads=2, head_dim=64, qk_norm=True)
    graphdef, state = nnx.split(Decoder(cfg, rngs=nnx.Rngs(seed)))
    state = jax.tree.map(lambda x: x * 20.0 if x.ndim == 2 else x, state)  # spread the logits
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(4, cfg.vocab_size, size=n).tolist() for n in (5, 17, 33, 12)]
    max_prompt, slots, k = 48, 4, 8
    sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)

    def generate(impl, drafter=None):
        eng = RolloutEngine(graphdef, cfg, EngineConfig(
            max_slots=slots, page_size=16, num_pages=0, max_prompt_len=max_prompt, max_new_tokens=new_tokens,
            eos_ids=(), attention_impl=impl, max_verify_tokens=slots * (k + 1)))
        return eng.generate(state, prompts, sp, jax.random.key(seed), drafter=drafter)

    results = []
    with jax.default_matmul_precision("highest"):
        want = generate("reference")
        runs = [("plain decode", None),
                ("oracle drafts K<=8", OracleDrafter(prompts, want.tokens, k, cfg.vocab_size, max_prompt + new_tokens))]
        for label, drafter in runs:
            got = generate(kernel, drafter)
            detail = []
            same = all(np.array_equal(a, b) for a, b in zip(got.tokens, want.tokens))
            lp_err = max(float(np.max(np.abs(a - b), initial=0.0)) for a, b in zip(got.logprobs, want.logprobs)) \
                if same else float("nan")
            if not same:
                first = next(i for i, (a, b) in enumerate(zip(got.tokens, want.tokens)) if not np.array_equal(a, b))
                detail.append(f"tokens differ (prompt {first}: {got.tokens[first][:12]} vs {want.tokens[first][:12]})")
            elif lp_err > ENGINE_LOGPROB_TOL:
                detail.append(f"logprobs differ by {lp_err:.2e} > {ENGINE_LOGPROB_TOL}")
            st = got.stats
            if drafter is not None and not (0 < st["accepted_tokens"] < st["drafted_tokens"]):
                detail.append(f"verify path not exercised (drafted {st['drafted_tokens']}, accepted "
                              f"{st['accepted_tokens']})")
            results.append(dict(group="engine", name=f"greedy reference vs {kernel}, {label}", max_abs_err=lp_err,
                                status="FAIL" if detail else "PASS",
                                detail="; ".join(detail) or (f"drafted {st['drafted_tokens']}, accepted "
                                                             f"{st['accepted_tokens']}" if drafter else ""),
                                stats=dict(drafted=st["drafted_tokens"], accepted=st["accepted_tokens"],
                                           forward_passes=st["forward_passes"])))
    return results


def _print(res: dict) -> None:
    err = res.get("max_abs_err")
    print(f"{res['status']:<4}  {res['group']:<8} {res['name']:<60} max_err "
          f"{'-' if err is None else format(err, '.2e')}  {res.get('detail', '')}", flush=True)


def run_checks(args) -> int:
    """``python -m benchmarks.kernels --check-only``: every check, printed and written to
    ``<args.out>/checks.json``. Reads ``args.kernel_impl``, ``max_cases``, ``seed``,
    ``no_engine``, ``engine_new_tokens``, ``out``. Returns the exit code: 0 all passed, 1 a check
    failed, 2 an unknown ``--kernel-impl``."""
    from rhyme_jax.io.atomic import atomic_write

    backend = jax.default_backend()
    kernel = args.kernel_impl or DEFAULT_KERNEL.get(backend, "reference")
    try:
        api.resolve_name(kernel)
    except ValueError as exc:
        print(f"python -m benchmarks.kernels --check-only: --kernel-impl: {exc}", file=sys.stderr)
        return 2
    print(f"checking {kernel!r} on {jax.devices()[0].device_kind} ({backend}), jax {jax.__version__}", flush=True)
    t0 = time.perf_counter()
    results = []

    def record(fn, *a, name):
        try:
            out = fn(*a)
        except Exception as exc:  # a crash is a failed check, not the end of the run
            out = dict(group=name, name=name, max_abs_err=None, status="FAIL",
                       detail=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
        for r in out if isinstance(out, list) else [out]:
            _print(r)
            results.append(r)

    cases = ragged_cases()
    if args.max_cases:
        cases = cases[: args.max_cases]
    for i, case in enumerate(cases):
        record(check_ragged, kernel, case, args.seed + i, name=case["name"])
    if kernel.startswith("pallas_gpu"):
        record(check_write_kv, kernel, name="write_kv")
    if not args.no_engine:
        record(check_engine, kernel, args.engine_new_tokens, name="engine")
    failed = [r for r in results if r["status"] != "PASS"]
    summary = dict(kernel=kernel, backend=backend, device_kind=jax.devices()[0].device_kind, jax=jax.__version__,
                   passed=len(results) - len(failed), failed=len(failed), seconds=time.perf_counter() - t0)
    with atomic_write(Path(args.out) / "checks.json", "w") as fh:
        json.dump(dict(summary=summary, results=results), fh, indent=1, default=str)
    print(f"{summary['passed']} passed, {summary['failed']} failed in {summary['seconds']:.0f} s; "
          f"wrote {Path(args.out) / 'checks.json'}", flush=True)
    return 1 if failed else 0
