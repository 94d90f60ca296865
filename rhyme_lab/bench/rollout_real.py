"""Plain decode vs HistoSpec rollouts on a real model (``python -m benchmarks.rollout_real``; its
module docstring describes the method): the workload's set-up (``load_setup``), one temperature's
epochs (``run_temperature``), the bulk / tail split, the RhymeRL analysis and the report.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rhyme_lab.bench import real_workload

DEFAULTS = dict(real_workload.DEFAULTS, max_slots=16, max_prompt_len=256)
# max_prompt_len 0: the longest prompt rounded up to a page (fewer page-table widths to warm up)
# HistoSpec with the goodput policy (--goodput): every draft source, acceptance estimates and the
# engine's cost-aware allocation under the pass-cost profile of this machine
GOODPUT = dict(window="goodput", pattern_min=1, self_lookup=True, siblings=True, min_token_prob=0.0)
QUICK = dict(real_workload.QUICK, max_slots=4, max_new_tokens=24, max_prompt_len=0)
KINDS = (("plain", "plain"), ("spec", "HistoSpec"))


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
    from rhyme_jax.rollout.engine import EngineConfig, RolloutEngine
    from rhyme_jax.train.policy import eos_ids

    path = real_workload.model_dir(args.model)
    model_cfg, model = load_hf_checkpoint(path, dtype=jnp.dtype(args.dtype))
    tokenizer = Tokenizer.from_file(path)
    graphdef, state = nnx.split(model)
    probs = real_workload.problems(args.prompts)
    toks = [tokenizer.encode(t) for t in real_workload.prompt_texts([p.question for p in probs])]
    if not args.max_prompt_len:
        args.max_prompt_len = -(-max(map(len, toks)) // args.page_size) * args.page_size
    engine = RolloutEngine(graphdef, model_cfg, EngineConfig(
        max_slots=args.max_slots, page_size=args.page_size, num_pages=0, max_prompt_len=args.max_prompt_len,
        max_new_tokens=args.max_new_tokens, eos_ids=eos_ids(model_cfg, tokenizer), attention_impl="auto"))
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
    """``python -m rhyme_lab analyze`` of one temperature's rollouts (paper drafter settings): O5 (share of
    epoch-2 tokens the drafter over epoch 1 predicts), O6 (share of prompts whose length rank
    moved by more than a decile); also writes ``analysis.{md,json,png}`` there."""
    from rhyme_lab.analyze import analyze, write_analysis

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
