"""Plain decode vs HistoSpec rollouts on a real model: SmolLM2-135M-Instruct on GSM8K.

The shared real-model workload (``real_workload.py``: GSM8K train questions in the model's chat
template). Per sampling temperature: epoch 1 is a plain-decode rollout of every row (P prompts x
N samples, more rows than ``--max-slots`` so there is a queue, as in RL; key k1); its rewards
(``last_number``) go into a ``HistoryStore`` exactly as the trainer writes them back (step 1,
prompt id = problem id, each prompt's samples grouped) and the drafter's indexes are rebuilt.
Epoch 2 then runs twice on the same weights, prompt tokens and key k2 (``--repeats R``: R rounds
of both, interleaved, tokens/s from each one's median seconds): plain decode, and
HistoSpec with the paper defaults (a default ``SpecSection``: reward branch, AIMD window,
pattern 7/3, min_token_prob 0.1). Timed rollouts run on compiled programs: ``--warmup full``
compiles every step shape first (``engine.warmup``, all draft buckets; the default on
accelerators), ``--warmup rehearse`` (the default on CPU, where the ~200 shapes of a 30-layer model
take about an hour to compile) replays an epoch-2 rollout that compiled anything (same inputs and
key: a deterministic replay that meets only compiled shapes) and keeps the replay's timing; ``--no-warmup`` does
neither. XLA compilations inside the timed rollouts are counted and reported (should be 0; epoch 1
compiles under ``rehearse``).

Side by side per temperature: tokens/s and its ratio; batch forward passes (one prefill, decode or
verify step = one pass) and their ratio; generated tokens per sequence forward pass; acceptance
(accepted / drafted tokens); host drafting share of HistoSpec time; response lengths (mean, p50,
p90, max); the mean per-token entropy of the sampled distribution, estimated as the mean of
-logprob of the plain epoch-2 tokens (their behaviour logprobs under the temperature-scaled
distribution they were drawn from: an unbiased estimate, nats/token); and the bulk / tail split:
the tail is the part of a rollout in which fewer than a quarter of the slots are live (timed per
decode step through ``generate``'s ``monitor``). RhymeRL O5/O6 (``rhyme-jax analyze``) of each
temperature's saved rollouts close the report.

Usage::

    python benchmarks/rollout_real.py              # 8 prompts x 4 samples on 16 slots, T = 1.0, 0.6, 0.3
    python benchmarks/rollout_real.py --quick      # smoke run (2 x 2 rows, 24 new tokens, T = 1.0)

On 2 shared CPU cores the defaults take about an hour (rehearsals included; 4 x 4 rows on 8 slots
took 27 min for one temperature), ``--quick`` about 2 minutes.

Writes ``<out>/rollout_real.{json,md}`` (rewritten after every temperature) and per temperature
``<out>/T<temp>/rollouts/step_000001.npz`` (epoch 1), ``step_000002.npz`` (epoch 2 HistoSpec),
``<out>/T<temp>/plain_epoch2/rollouts/step_000002.npz`` and the analysis files of
``rhyme-jax analyze <out>/T<temp>``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import real_workload  # noqa: E402

DEFAULTS = dict(real_workload.DEFAULTS, max_slots=16, max_prompt_len=256)
# max_prompt_len 0: the longest prompt rounded up to a page (fewer page-table widths to warm up)
# HistoSpec with the goodput policy (--goodput): every draft source, acceptance estimates and the
# engine's cost-aware allocation under the step-cost profile of this machine
GOODPUT = dict(window="goodput", pattern_min=1, self_lookup=True, siblings=True, min_token_prob=0.0)
QUICK = dict(real_workload.QUICK, max_slots=4, max_new_tokens=24, max_prompt_len=0)
KINDS = (("plain", "plain"), ("spec", "HistoSpec"))


def parse_args(argv=None) -> argparse.Namespace:
    """Command line; sizes left unset take ``QUICK`` under ``--quick``, else ``DEFAULTS``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, help=f"GSM8K train prompts (default {DEFAULTS['prompts']})")
    ap.add_argument("--samples", type=int, help=f"samples per prompt (default {DEFAULTS['samples']})")
    ap.add_argument("--max-slots", type=int, help=f"decode slots (default {DEFAULTS['max_slots']})")
    ap.add_argument("--max-new-tokens", type=int, help=f"default {DEFAULTS['max_new_tokens']}")
    ap.add_argument("--temperatures", help=f"comma-separated (default {DEFAULTS['temperatures']})")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--goodput", action="store_true",
                    help="also run HistoSpec with the goodput policy (GOODPUT) beside the paper defaults")
    ap.add_argument("--max-prompt-len", type=int, help="default 256; 0 = the longest prompt, page-rounded")
    ap.add_argument("--repeats", type=int, default=1,
                    help="epoch-2 rounds (plain, then each HistoSpec variant, interleaved); tokens/s from "
                         "the median seconds of each (the same key and a fresh drafter: the same tokens)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0, help="rollout keys k1, k2 = split(key(seed))")
    ap.add_argument("--model", default="", help="HF checkpoint dir (default: real_workload.model_dir())")
    ap.add_argument("--out", default="runs/bench_rollout_real")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    ap.add_argument("--warmup", choices=("auto", "full", "rehearse", "none"), default="auto",
                    help="full: compile every step shape first (engine.warmup); rehearse: replay (and time "
                         "again) an epoch-2 rollout that compiled; auto: full on accelerators, rehearse on CPU")
    ap.add_argument("--no-warmup", dest="warmup", action="store_const", const="none", help="--warmup none")
    ap.add_argument("--compile-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--compile-cache", default="runs/.jax_cache", help="persistent XLA cache ('' = off)")
    args = ap.parse_args(argv)
    return real_workload.fill_defaults(args, QUICK if args.quick else DEFAULTS)


@dataclass
class Setup:
    """Model, engine and workload: ``ids`` (problem id per row), ``prompts`` (token ids per row,
    each prompt's samples consecutive) and ``problems`` (per row)."""

    engine: object
    state: object
    tokenizer: object
    ids: np.ndarray
    prompts: list
    problems: list
    params: int


def load_setup(args) -> Setup:
    """Load the checkpoint and tokenizer, build the engine and the rows of the workload."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from rhyme_jax.model.loader import load_hf_checkpoint
    from rhyme_jax.model.tokenizer import Tokenizer
    from rhyme_jax.rollout.engine import RolloutEngine
    from rhyme_jax.train.policy import eos_ids

    path = real_workload.model_dir(args.model)
    model_cfg, model = load_hf_checkpoint(path, dtype=jnp.dtype(args.dtype))
    tokenizer = Tokenizer.from_file(path)
    graphdef, state = nnx.split(model)
    probs = real_workload.problems(args.prompts)
    toks = [tokenizer.encode(t) for t in real_workload.prompt_texts([p.question for p in probs])]
    if not args.max_prompt_len:
        args.max_prompt_len = -(-max(map(len, toks)) // args.page_size) * args.page_size
    engine = RolloutEngine(graphdef, model_cfg, max_slots=args.max_slots, page_size=args.page_size,
                           num_pages=0, max_prompt_len=args.max_prompt_len,
                           max_new_tokens=args.max_new_tokens, eos_ids=eos_ids(model_cfg, tokenizer),
                           attention_impl="auto")
    rows = [i for i in range(len(probs)) for _ in range(args.samples)]
    params = sum(int(x.size) for x in jax.tree.leaves(state))
    return Setup(engine, state, tokenizer, np.array([probs[i].id for i in rows], np.int64),
                 [toks[i] for i in rows], [probs[i] for i in rows], params)


def warm_up(setup: Setup, args) -> tuple[float, int]:
    """Compile every prefill / decode / verify program (``engine.programs(spec=True)``) once per sampling
    program the temperatures use; returns ``(seconds, shapes)``."""
    from rhyme_jax.rollout.engine import SamplingParams

    t0, shapes, modes = time.perf_counter(), 0, set()
    for temp in args.temperatures:
        sp = SamplingParams(temperature=temp, max_new_tokens=args.max_new_tokens)
        if sp.mode in modes:
            continue
        modes.add(sp.mode)
        shapes += setup.engine.warmup(setup.state, sp, spec=True,
                                      compile_threads=args.compile_threads)
    return time.perf_counter() - t0, shapes


def timed_rollout(setup: Setup, sp, key, drafter=None):
    """One ``generate`` of every row: ``(result, compiles inside it, trace, start time)``; the
    trace has one ``(time, live rows, tokens emitted)`` per decode step (``monitor``; nothing is
    stopped). A row is live in a step when its token count grew (prefill tokens included)."""
    from rhyme_jax.compile_count import CompileCounter

    trace, prev = [], [np.zeros(len(setup.prompts), np.int64)]

    def monitor(p):
        grew = p.generated - prev[0]
        trace.append((time.perf_counter(), int((grew > 0).sum()), int(grew.sum())))
        prev[0] = p.generated
        return []

    with CompileCounter() as cc:
        t0 = time.perf_counter()
        res = setup.engine.generate(setup.state, setup.prompts, sp, key, drafter=drafter, monitor=monitor)
    return res, cc.count, trace, t0


def phase_split(trace, t0: float, stats: dict, max_slots: int) -> dict:
    """Seconds, forward passes and tokens in the bulk vs the tail (decode steps with fewer than
    ``max_slots / 4`` live rows; the queue is empty then, so the tail has no prefill passes)."""
    tail = dict(seconds=0.0, passes=0, tokens=0)
    prev = t0
    for t, live, emitted in trace:
        if live < max_slots / 4:
            tail["seconds"] += t - prev
            tail["passes"] += 1
            tail["tokens"] += emitted
        prev = t
    bulk = dict(seconds=stats["seconds"] - tail["seconds"], passes=stats["forward_passes"] - tail["passes"],
                tokens=stats["generated_tokens"] - tail["tokens"])
    return {"bulk": bulk, "tail": tail, "tail_time_share": tail["seconds"] / max(stats["seconds"], 1e-9)}


def rewards_of(setup: Setup, tokens) -> np.ndarray:
    """``last_number`` reward of each row's response (as the SmolLM2 recipe's trainer scores it)."""
    from rhyme_jax.data.rewards import reward_fn

    fn = reward_fn("last_number")
    return np.array([fn(setup.tokenizer.decode(t), p) for t, p in zip(tokens, setup.problems)], np.float32)


def summarize(setup: Setup, res, compiles: int, trace, t0: float) -> dict:
    """Stats of one rollout: counts, rates, length distribution, rewards and the bulk/tail split."""
    s = res.stats
    lengths = np.array([len(t) for t in res.tokens])
    rewards = rewards_of(setup, res.tokens)
    return {
        **{k: s[k] for k in ("generated_tokens", "seconds", "tokens_per_s", "forward_passes", "decode_steps",
                             "prefill_steps", "sequence_steps", "drafted_tokens", "accepted_tokens",
                             "drafting_seconds", "preemptions")},
        "tokens_per_seq_forward": s["tokens_per_forward"], "acceptance": s["acceptance_rate"],
        "drafting_share": s["drafting_seconds"] / max(s["seconds"], 1e-9), "compiles": compiles,
        "lengths": {"mean": float(lengths.mean()), "p50": float(np.percentile(lengths, 50)),
                    "p90": float(np.percentile(lengths, 90)), "max": int(lengths.max())},
        "eos_share": float(np.mean([f == "eos" for f in res.finish_reasons])),
        "reward_mean": float(rewards.mean()), "rewards": rewards,
        **phase_split(trace, t0, s, setup.engine.max_slots),
    }


def run_temperature(setup: Setup, temp: float, args, out: Path) -> dict:
    """Epoch 1 (plain, history write-back, index rebuild), then epoch 2 plain and HistoSpec on the
    same key; rollouts saved under ``out/T<temp>``, analysed there (O5/O6). Returns the report row."""
    import jax

    from rhyme_jax.config import SpecSection
    from rhyme_jax.rollout.engine import SamplingParams
    from rhyme_jax.spec.drafter import Drafter
    from rhyme_jax.spec.history import HistoryStore
    from rhyme_jax.io.rollout_log import save_rollouts

    sp = SamplingParams(temperature=temp, max_new_tokens=args.max_new_tokens)
    k1, k2 = jax.random.split(jax.random.key(args.seed))
    tdir = out / f"T{temp}"
    spec_cfg = SpecSection()  # the paper defaults
    variants = {"spec": spec_cfg}
    if args.goodput:
        variants["goodput"] = SpecSection(**GOODPUT)
    store = HistoryStore(spec_cfg.history_depth)
    row = {"temperature": temp}

    def rollout(name, key, drafter=None, run_dir=tdir, step=1):
        # rehearse: a timed rollout that compiled is replayed (same inputs and key: the same
        # tokens and shapes) and the replay's timing kept; later temperatures reuse the programs
        for attempt in range(2):
            # fresh windows; waits for the index builds (not timed)
            batch = drafter.batch(setup.ids.tolist()) if drafter is not None else None
            res, *timing = timed_rollout(setup, sp, key, batch)
            x = summarize(setup, res, *timing)
            if args.warmup != "rehearse" or name == "epoch1" or x["compiles"] == 0 or attempt:
                break
            row["rehearsal_s"] = row.get("rehearsal_s", 0.0) + x["seconds"]
            print(f"T={temp} {name}: {x['compiles']} compiles in {x['seconds']:.1f} s; replaying", flush=True)
        row[name] = x
        print(f"T={temp} {name}: {x['generated_tokens']} tokens in {x['seconds']:.1f} s ({x['tokens_per_s']:.1f} "
              f"tok/s), {x['forward_passes']} passes, {x['compiles']} compiles", flush=True)
        save_rollouts(run_dir, step, setup.ids, res.tokens, row[name]["rewards"], res.logprobs)
        return res

    res1 = rollout("epoch1", k1)
    # write-back as the trainer does (step 1); each variant's drafter indexes the store
    store.update(1, setup.ids, [np.asarray(p, np.int32) for p in setup.prompts], res1.tokens,
                 row["epoch1"]["rewards"])
    seconds = {name: [] for name in ("plain", *variants)}
    for _ in range(max(1, args.repeats)):  # rounds: the machine's drift hits every variant alike
        plain = rollout("plain", k2, run_dir=tdir / "plain_epoch2", step=2)
        seconds["plain"].append(row["plain"]["seconds"])
        for name, cfg in variants.items():
            with Drafter(cfg, store) as drafter:  # fresh: every round drafts the same
                drafter.rebuild(np.unique(setup.ids).tolist())
                rollout(name, k2, drafter, run_dir=tdir if name == "spec" else tdir / name, step=2)
            seconds[name].append(row[name]["seconds"])
    for name, secs in seconds.items():  # the other figures are the last round's
        x = row[name]
        x["seconds_rounds"], x["seconds"] = secs, float(np.median(secs))
        x["tokens_per_s"] = x["generated_tokens"] / x["seconds"]
    for name in variants:
        row[f"{name}_speedup"] = row[name]["tokens_per_s"] / row["plain"]["tokens_per_s"]
    lp = np.concatenate(plain.logprobs).astype(np.float64)
    row["entropy_nats_per_token"] = float(-lp.mean()) if lp.size else float("nan")
    row["speedup"] = row["spec"]["tokens_per_s"] / row["plain"]["tokens_per_s"]
    row["passes_ratio"] = row["plain"]["forward_passes"] / max(row["spec"]["forward_passes"], 1)
    row["analysis"] = analyze_dir(tdir)
    for k in ("epoch1", "plain", *variants):
        del row[k]["rewards"]  # per row in the saved rollouts
    return row


def analyze_dir(tdir: Path) -> dict:
    """``rhyme-jax analyze`` of one temperature's rollouts (paper drafter settings): O5 (share of
    epoch-2 tokens the drafter over epoch 1 predicts), O6 (share of prompts whose length rank
    moved by more than a decile); also writes ``analysis.{md,json,png}`` there."""
    from rhyme_jax.spec.analyze import analyze, write_analysis

    result = analyze(tdir)
    write_analysis(tdir, result)
    o = result["overall"]
    return {"o5_rhyme": o["rhyme"], "o6_rank_shift_share": o["rank_shift_share"], "prompts": o["prompts"],
            "responses": o["responses"], "tokens": o["tokens"], "predicted": o["predicted"]}


def format_table(row: dict) -> str:
    """Markdown table of one temperature: plain vs HistoSpec (paper defaults, and the goodput
    policy when run) side by side, then notes."""
    p, h, e1, a = row["plain"], row["spec"], row["epoch1"], row["analysis"]
    spec = [row[k] for k in ("spec", "goodput") if k in row]

    def both(fmt, get, ratio=None):
        cells = [fmt.format(get(x)) for x in (p, *spec)]
        return cells + ([f"{get(x) / get(p):.2f}x" for x in spec] if ratio else [""] * len(spec))

    def lens(x):
        d = x["lengths"]
        return f"{d['mean']:.0f} / {d['p50']:.0f} / {d['p90']:.0f} / {d['max']}"

    def phase(x, ph):
        return f"{x[ph]['seconds']:.1f} s, {x[ph]['passes']} passes, {x[ph]['tokens']} tok"

    def spec_only(fn):
        return ["-"] + [fn(x) for x in spec] + [""] * len(spec)

    rows = [
        ("generated tokens", both("{}", lambda x: x["generated_tokens"])),
        ("rollout seconds (median of rounds: each round)",
         both("{}", lambda x: f"{x['seconds']:.1f}: " + " / ".join(f"{t:.1f}" for t in x.get("seconds_rounds", [])))),
        ("tokens/s", both("{:.1f}", lambda x: x["tokens_per_s"], True)),
        ("batch forward passes", both("{}", lambda x: x["forward_passes"], True)),
        ("tokens per sequence forward pass", both("{:.2f}", lambda x: x["tokens_per_seq_forward"])),
        ("acceptance (accepted / drafted)",
         spec_only(lambda x: f"{x['acceptance']:.2f} ({x['accepted_tokens']} / {x['drafted_tokens']})")),
        ("host drafting share of rollout time", spec_only(lambda x: f"{100 * x['drafting_share']:.1f}%")),
        ("response length mean / p50 / p90 / max", [lens(x) for x in (p, *spec)] + [""] * len(spec)),
        ("EOS share / reward mean", both("{}", lambda x: f"{x['eos_share']:.2f} / {x['reward_mean']:.2f}")),
        ("bulk (>= 1/4 of slots live)", [phase(x, "bulk") for x in (p, *spec)] + [""] * len(spec)),
        ("tail (< 1/4 of slots live)", [phase(x, "tail") for x in (p, *spec)] + [""] * len(spec)),
        ("tail share of rollout time", both("{:.1%}", lambda x: x["tail_time_share"])),
        ("compiles in the timed rollout", both("{}", lambda x: x["compiles"])),
    ]
    names = ["HistoSpec paper", "HistoSpec goodput"][: len(spec)]
    head = ["epoch 2", "plain", *names, *[f"{n} vs plain" for n in names]]
    lines = [f"### T = {row['temperature']}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [f"| {name} | " + " | ".join(c) + " |" for name, c in rows]
    lines += ["", f"Mean per-token entropy of the sampled distribution: {row['entropy_nats_per_token']:.3f} "
              "nats/token (mean -logprob of the plain epoch-2 tokens under the distribution they were drawn "
              "from: an unbiased estimate).",
              f"Epoch 1 (plain, history source): {e1['generated_tokens']} tokens, {e1['tokens_per_s']:.1f} tok/s, "
              f"length mean {e1['lengths']['mean']:.0f}, reward mean {e1['reward_mean']:.2f}, "
              f"{e1['compiles']} compiles" + (f"; replays of epoch-2 rollouts that compiled: {row['rehearsal_s']:.0f} s."
                                               if "rehearsal_s" in row else "."),
              f"RhymeRL analyze (epoch 2 vs 1, {a['prompts']} prompts, {a['tokens']} tokens): O5 rhyme "
              f"{a['o5_rhyme']:.1%} of tokens predicted (paper 75-95%), O6 {a['o6_rank_shift_share']:.1%} of "
              "prompts moved > a decile in length rank (paper 2-4%)."]
    return "\n".join(lines)


def write_report(rows: list[dict], meta: dict, out: Path) -> str:
    """``out``/rollout_real.{md,json} with every temperature done so far; returns the markdown."""
    head = ["# Rollout benchmark on a real model: plain decode vs HistoSpec", "",
            " | ".join(f"{k}: {v}" for k, v in meta.items()), ""]
    text = "\n".join(head + ["\n\n".join(format_table(r) for r in rows)]) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "rollout_real.md").write_text(text)
    (out / "rollout_real.json").write_text(json.dumps({"meta": meta, "temperatures": rows}, indent=1, default=float))
    return text


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    if args.compile_cache:  # warm-up is never timed; the cache only saves repeated compiles
        jax.config.update("jax_compilation_cache_dir", str(Path(args.compile_cache)))
    if args.warmup == "auto":  # a CPU compiles the ~200 step shapes of a full warm-up in about an hour
        args.warmup = "rehearse" if jax.default_backend() == "cpu" else "full"
    out = Path(args.out)
    t0 = time.perf_counter()
    setup = load_setup(args)
    load_s = time.perf_counter() - t0
    warm_s, shapes = warm_up(setup, args) if args.warmup == "full" else (0.0, 0)
    lens = [len(p) for p in setup.prompts]
    meta = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "attention_impl": setup.engine.attention_impl, "model": real_workload.MODEL,
            "model_dir": str(real_workload.model_dir(args.model)), "params": setup.params, "dtype": args.dtype,
            "prompts": args.prompts, "samples": args.samples, "rows": len(setup.prompts),
            "max_slots": args.max_slots, "max_new_tokens": args.max_new_tokens, "page_size": args.page_size,
            "max_prompt_len": args.max_prompt_len, "prompt_tokens_mean_max": f"{np.mean(lens):.0f}/{max(lens)}",
            "load_s": round(load_s, 1), "warmup": args.warmup, "warmup_s": round(warm_s, 1),
            "warmup_shapes": shapes, "compile_threads": args.compile_threads}
    print(f"loaded in {load_s:.1f} s; warm-up {args.warmup}: {warm_s:.1f} s, {shapes} step shapes", flush=True)
    if args.goodput:  # the goodput policy's step-cost model: cached profile of this machine, or profiled now
        from rhyme_jax.rollout.engine import SamplingParams

        cost = setup.engine.use_step_cost(setup.state, SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens))
        meta["step_cost"] = f"{len(cost.seconds)} programs ({cost.meta.get('source', '')})"
    rows = []
    for temp in args.temperatures:
        rows.append(run_temperature(setup, temp, args, out))
        write_report(rows, meta, out)  # after every temperature: a killed run keeps the rest
        print(format_table(rows[-1]), flush=True)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; written: {out / 'rollout_real.md'}, {out / 'rollout_real.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
