"""Figures of the ids measured on the rollout session (A5, A10, K1-K6, O5, O6).

Live figures compare epoch 2 plain with epoch 2 HistoSpec on the same key (``session.py``):
speed-up = HistoSpec tokens/s / plain tokens/s, fewer passes = plain batch forward passes /
HistoSpec's. Replayed figures (``replay.py``) pool nothing across (history, target) choices: each
choice is one sample, the table shows their mean ± standard deviation.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from rhyme_lab.ablate.measures import Inputs, MissingInput, _mean_std, figure, pm
from rhyme_lab.ablate.registry import ABLATIONS

REPLAY_METRICS = ("acceptance", "tokens_per_forward", "predicted_share", "hit_rate", "mean_draft")


def _session(inp: Inputs) -> dict:
    return inp.unit("real_session")


def _live(plain: dict, spec: dict) -> dict:
    """Speed-up, fewer passes, acceptance and tokens per sequence pass of one HistoSpec call."""
    if "error" in spec:
        return {"error": spec["error"]}
    return {"speedup": spec["tokens_per_s"] / max(plain["tokens_per_s"], 1e-9),
            "passes": plain["forward_passes"] / max(spec["forward_passes"], 1.0),
            "acceptance": spec.get("acceptance_rate", 0.0), "tokens_per_forward": spec.get("tokens_per_forward", 1.0),
            "tokens_per_s": spec["tokens_per_s"], "plain_tokens_per_s": plain["tokens_per_s"]}


def _live_cell(x: dict) -> str:
    if "error" in x:
        return f"n/a ({x['error']})"
    return f"{x['speedup']:.2f}x tok/s, {x['passes']:.2f}x fewer passes, acc {x['acceptance']:.2f}"


def _setup_note(r: dict) -> str:
    t = r["temperatures"][0]
    e2 = t["plain"][1] if len(t["plain"]) > 1 else t["plain"][0]
    return (f"{Path(r['model']).name}, {r['prompts']} prompts x {r['samples']} samples, {r['max_new_tokens']} new "
            f"tokens, {r['max_slots']} slots, {r['attention_impl']} attention; plain epoch 2 at T={t['temperature']}: "
            f"{e2['tokens_per_s']:.1f} tok/s, mean length {e2['mean_length']:.0f}, reward {e2.get('reward_mean', 0):.2f}")


def a5(inp: Inputs) -> dict:
    r = _session(inp)
    t = r["temperatures"][0]
    points = [(b["rows"], _live(b["plain"], b["spec"])) for b in t.get("batch", [])]
    points.append((r["rows"], _live(t["plain"][1], t["spec"][r["spec"]["window"]])))
    figs = [figure("rollout speed-up (tokens/s)", f"{rows} rows", x.get("speedup")) for rows, x in points] + \
           [figure("fewer batch passes", f"{rows} rows", x.get("passes")) for rows, x in points]
    return {"ours": "; ".join(f"{rows} rows: {_live_cell(x)}" for rows, x in points), "figures": figs,
            "notes": _setup_note(r)}


def a10(inp: Inputs) -> dict:
    r = _session(inp)
    w = r["spec"]["window"]
    pts = [(t["temperature"], _live(t["plain"][1], t["spec"][w])) for t in r["temperatures"]]
    figs = [figure("rollout speed-up (tokens/s)", f"T={T}", x.get("speedup")) for T, x in pts] + \
           [figure("acceptance", f"T={T}", x.get("acceptance")) for T, x in pts]
    return {"ours": "; ".join(f"T={T}: {_live_cell(x)}" for T, x in pts), "figures": figs, "notes": _setup_note(r)}


class ReplayBench:
    """The session's plain epochs at its first temperature, replayed under spec overrides."""

    def __init__(self, r: dict):
        from rhyme_lab.ablate import replay
        from rhyme_jax.rollout import shapes

        t = r["temperatures"][0]
        self.dir, self.epochs = Path(t["dir"]), len(t["plain"])
        if self.epochs < 2:
            raise MissingInput("the session has one plain epoch; replays need two")
        prompts = json.loads((Path(r["run_dir"]) / "prompts.json").read_text())
        self.prompts = {int(k): v for k, v in prompts.items()}
        self.data = {e: replay.epoch_rollouts(self.dir, e) for e in range(1, self.epochs + 1)}
        self.spec, ro = dict(r["spec"]), r["rollout"]
        self.rows = int(ro["max_slots"])
        self.plan = shapes.plan(max_slots=self.rows, page_size=ro["page_size"], max_prompt_len=ro["max_prompt_len"],
                                max_new_tokens=ro["max_new_tokens"], max_verify_tokens=ro["max_verify_tokens"])

    def run(self, depth: int = 1, **over) -> dict:
        """Mean, spread and samples of ``REPLAY_METRICS`` over every (history, target) choice,
        and the pooled draft-length histogram."""
        from rhyme_lab.ablate import replay
        from rhyme_jax.config import SpecSection

        spec = SpecSection(**{**self.spec, **over, "history_depth": depth})
        sets = replay.epoch_sets(self.epochs, depth)
        if not sets:
            raise MissingInput(f"history depth {depth} needs {depth + 1} plain epochs, the session has {self.epochs}")
        runs = []
        for hist, target in sets:
            store = replay.history_store(self.prompts, [self.data[e] for e in hist], depth)
            runs.append(replay.replay(spec, store, replay.targets_of(self.prompts, self.data[target]), self.plan,
                                      self.rows))
        out = {k: _mean_std([x[k] for x in runs]) for k in REPLAY_METRICS}
        out["n"] = len(runs)
        out["draft_hist"] = np.sum([x["draft_hist"] for x in runs], axis=0).tolist()
        return out


def bench_run(inp: Inputs, depth: int = 1, **over) -> dict:
    """``ReplayBench.run`` cached per results directory."""
    key = (depth, tuple(sorted(over.items())))
    if "bench" not in inp._replays:
        inp._replays["bench"] = ReplayBench(_session(inp))
    if key not in inp._replays:
        inp._replays[key] = inp._replays["bench"].run(depth, **over)
    return inp._replays[key]


def _sweep(inp: Inputs, aid: str, metrics: tuple[str, ...], fmt: dict | None = None) -> dict:
    """One replayed figure per value of the id's sweep key (``registry.Ablation.sweep``)."""
    key, values = ABLATIONS[aid].sweep
    name = key.split(".")[-1]
    fmt = fmt or {}
    cells, figs, hists = [], [], {}
    for v in values:
        res = bench_run(inp, v) if name == "history_depth" else bench_run(inp, **{name: v})
        hists[f"{name}={v}"] = res["draft_hist"]
        parts = []
        for m in metrics:
            mean, sd = res[m]
            figs.append(figure(m, f"{name}={v}", mean, sd, res["n"]))
            parts.append(f"{m.replace('_', ' ')} {pm(mean, sd, fmt.get(m, '{:.2f}'))}")
        cells.append(f"{v}: " + ", ".join(parts))
    return {"ours": "; ".join(cells), "figures": figs, "hists": hists}


def _replay_note(inp: Inputs) -> str:
    b = inp._replays.get("bench")
    n = f"{b.epochs} plain epochs, every (history, target) choice" if b else "replay"
    return f"replayed along {n}; " + _setup_note(_session(inp))


def k1(inp: Inputs) -> dict:
    out = _sweep(inp, "K1", ("acceptance", "tokens_per_forward"))
    rewards = [p.get("reward_mean", 0.0) for p in _session(inp)["temperatures"][0]["plain"]]
    tie = " All rewards equal: the reward rule breaks every tie by count." if not any(rewards) else ""
    return {**out, "notes": _replay_note(inp) + "." + tie}


def k2(inp: Inputs) -> dict:
    out = _window_replay(inp)
    t = _session(inp)["temperatures"][0]
    live = [(w, _live(t["plain"][1], s)) for w, s in t["spec"].items()]
    out["figures"] += [figure("live rollout speed-up (tokens/s)", f"window={w}", x.get("speedup")) for w, x in live]
    out["figures"] += [figure("live tokens per forward", f"window={w}", x.get("tokens_per_forward")) for w, x in live]
    out["ours"] += "; live: " + "; ".join(f"{w}: " + (_live_cell(x) if "error" in x else
                                                      f"{x['tokens_per_forward']:.2f} tok/fwd, {x['speedup']:.2f}x tok/s")
                                          for w, x in live)
    out["notes"] = "goodput is sized by the engine, so it is timed live only; " + _replay_note(inp)
    return out


def _window_replay(inp: Inputs) -> dict:
    cells, figs, hists = [], [], {}
    for w in ("aimd", "mimd", "fixed"):
        res = bench_run(inp, window=w)
        hists[f"window={w}"] = res["draft_hist"]
        (tpf, sd), (acc, asd) = res["tokens_per_forward"], res["acceptance"]
        figs += [figure("tokens_per_forward", f"window={w}", tpf, sd, res["n"]),
                 figure("acceptance", f"window={w}", acc, asd, res["n"])]
        cells.append(f"{w}{'(8)' if w == 'fixed' else ''}: {pm(tpf, sd)} tok/fwd")
    return {"ours": "replay: " + ", ".join(cells), "figures": figs, "hists": hists}


def k3(inp: Inputs) -> dict:
    return {**_sweep(inp, "K3", ("hit_rate", "acceptance")), "notes": _replay_note(inp)}


def k4(inp: Inputs) -> dict:
    return {**_sweep(inp, "K4", ("mean_draft", "acceptance")), "notes": _replay_note(inp)}


def k6(inp: Inputs) -> dict:
    return {**_sweep(inp, "K6", ("acceptance", "tokens_per_forward")),
            "notes": "one fixed policy, so a deeper history only adds samples of the same distribution (in "
                     "training older epochs come from older policies); " + _replay_note(inp)}


def _analysis(path: Path) -> dict:
    from rhyme_lab.analyze import analyze

    return analyze(path)["overall"]


def _rhyme_sources(inp: Inputs) -> list[tuple[str, dict]]:
    """``(label, analyze overall)`` of the demo training run and the real-model session."""
    out = []
    try:
        a = inp.unit("e2e_histospec")["analysis"]
        out.append(("demo GRPO run (e2e_histospec)", a.get("overall") or {"error": a.get("error")}))
    except MissingInput as exc:
        out.append(("demo GRPO run", {"error": str(exc)}))
    try:
        r = _session(inp)
        out.append((f"{Path(r['model']).name} session", _analysis(Path(r["temperatures"][0]["dir"]))))
    except (MissingInput, ValueError) as exc:
        out.append(("real-model session", {"error": str(exc)}))
    if all("error" in x for _, x in out):
        raise MissingInput("; ".join(f"{k}: {x['error']}" for k, x in out))
    return out


def _rhyme(inp: Inputs, key: str, metric: str, note: str = "") -> dict:
    cells, figs = [], []
    for label, x in _rhyme_sources(inp):
        if "error" in x:
            cells.append(f"{label}: n/a ({x['error']})")
            continue
        figs.append(figure(metric, label, x[key], n=x["prompts"]))
        cells.append(f"{label}: {100 * x[key]:.1f}% ({x['prompts']} prompt-epochs, {x['tokens']} tokens)")
    return {"ours": "; ".join(cells), "figures": figs,
            "notes": "python -m rhyme_lab analyze (paper drafter, teacher-forced); the session's epochs come from one "
                     "fixed policy, the demo run's from a policy in training" + note}


def o5(inp: Inputs) -> dict:
    return _rhyme(inp, "rhyme", "share of tokens predicted")


def o6(inp: Inputs) -> dict:
    return _rhyme(inp, "rank_shift_share", "share of prompts moved > a decile in length rank",
                  "; a prompt's rank is among the prompts of its step (the demo run's grpo.prompts_per_step: 16 "
                  "in the full suite, 8 in the quick one; the session's 4 or 8 in all), so with few prompts "
                  "one place is more than a decile")
