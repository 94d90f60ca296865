"""Peer rollout engines on rhyme-jax's real workload (``python -m benchmarks.peers``; its module
docstring describes the method): the workload's token ids, transformers ``generate`` and Tunix's
sampler (a subprocess in its own venv) timed on them, rhyme-jax's own rows read from
``benchmarks.rollout_real``'s report, and the tables. torch / transformers are imported only
inside the functions that use them.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np

from rhyme_lab.bench import real_workload

EOS_ID = 2  # <|im_end|>
TUNIX_PYTHON = real_workload.ROOT / ".venv-tunix" / "bin" / "python"
TUNIX_WORKER = "benchmarks.peer_tunix_worker"  # run as ``python -m`` from the repository root


def length_stats(lengths) -> dict:
    """Mean / p50 / p90 / max of response lengths (tokens), with their count and sum."""
    a = np.asarray(lengths, np.float64)
    if a.size == 0:
        return dict(n=0, total=0, mean=None, p50=None, p90=None, max=None)
    return dict(n=int(a.size), total=int(a.sum()), mean=float(a.mean()), p50=float(np.percentile(a, 50)),
                p90=float(np.percentile(a, 90)), max=int(a.max()))


def response_lengths(rows, eos_id: int = EOS_ID, limit: int | None = None) -> list[int]:
    """Per row of generated ids: tokens up to and including the first EOS (all of them without
    one), capped at ``limit``."""
    out = []
    for row in rows:
        row = np.asarray(row)
        hit = np.flatnonzero(row == eos_id)
        n = int(hit[0]) + 1 if hit.size else int(row.size)
        out.append(min(n, limit) if limit else n)
    return out


def workload(args) -> dict:
    """Model directory and the rows' prompt texts and token ids (prompts x samples, groups adjacent)."""
    from tokenizers import Tokenizer

    mdir = real_workload.model_dir(args.model_dir)
    texts = real_workload.prompt_texts(real_workload.questions(args.prompts))
    tok = Tokenizer.from_file(str(mdir / "tokenizer.json"))
    ids = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    rows = [i for i in range(len(texts)) for _ in range(args.samples)]
    return dict(model_dir=str(mdir), prompt_ids=[ids[i] for i in rows],
                prompt_lens=length_stats([len(x) for x in ids]))


def _left_pad(batch: list[list[int]], pad_id: int):
    import torch

    width = max(len(x) for x in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, x in enumerate(batch):
        ids[r, width - len(x):] = torch.tensor(x)
        mask[r, width - len(x):] = 1
    return ids, mask


def run_hf(work: dict, args) -> dict:
    """transformers ``generate``: per temperature, tokens/s and response lengths."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    threads = args.torch_threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(work["model_dir"], dtype=torch.float32).eval()
    rows = work["prompt_ids"]
    batches = [rows[i: i + args.batch] for i in range(0, len(rows), args.batch)]
    padded = [_left_pad(b, EOS_ID) for b in batches]

    def generate(ids, mask, temperature, new_tokens):
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                 temperature=temperature, top_k=0, top_p=1.0,
                                 max_new_tokens=new_tokens, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
        return out[:, ids.shape[1]:].numpy()

    t0 = time.perf_counter()
    generate(*padded[0], args.temperatures[0], min(8, args.max_new_tokens))  # warm-up
    warmup_s = time.perf_counter() - t0
    result = {}
    for temp in args.temperatures:
        torch.manual_seed(args.seed)
        lengths, seconds = [], 0.0
        for ids, mask in padded:
            t0 = time.perf_counter()
            gen = generate(ids, mask, temp, args.max_new_tokens)
            seconds += time.perf_counter() - t0
            lengths += response_lengths(gen, EOS_ID, args.max_new_tokens)
        result[_tkey(temp)] = dict(tokens_per_s=sum(lengths) / seconds, seconds=seconds,
                                   generated_tokens=int(sum(lengths)), lengths=length_stats(lengths))
        print(f"  hf T={temp}: {sum(lengths) / seconds:.1f} tok/s, {seconds:.1f} s", flush=True)
    settings = dict(batch=args.batch, dtype="float32", device="cpu", torch_threads=threads, padding="left",
                    kv_cache="transformers default (dynamic)", top_k=0, top_p=1.0)
    return dict(engine="transformers generate", status="ok", settings=settings, warmup_s=warmup_s,
                versions=dict(transformers=transformers.__version__, torch=torch.__version__),
                temperatures=result)


def _tkey(temp: float) -> str:
    """Temperature as a JSON key: ``1.0``, ``0.6``."""
    return f"{float(temp):g}" if float(temp) != int(temp) else f"{float(temp):.1f}"


def run_tunix(work: dict, args) -> dict:
    """Tunix's sampler through ``python -m benchmarks.peer_tunix_worker`` (from the repository root)
    in Tunix's own venv (``args.tunix_python``), fed ``work`` (``workload``) as one JSON request.

    Returns the worker's report (per temperature tokens/s and ``lengths``), or a ``status``
    "not installed" / "failed" entry with the reason; never raises for a failed worker."""
    base = dict(engine="Tunix sampler", settings=dict(batch=args.batch, dtype="float32", venv=str(args.tunix_python)))
    if not Path(args.tunix_python).exists():
        return dict(base, status="not installed",
                    error=f"{args.tunix_python} missing: python3 -m venv .venv-tunix && "
                          ".venv-tunix/bin/pip install google-tunix==0.1.7")
    req = dict(model_dir=work["model_dir"], prompt_ids=work["prompt_ids"], batch=args.batch,
               max_new_tokens=args.max_new_tokens, temperatures=args.temperatures, seed=args.seed,
               eos_id=EOS_ID, check=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH="")  # its own packages only, CPU like the others
    try:
        proc = subprocess.run([str(args.tunix_python), "-m", TUNIX_WORKER], input=json.dumps(req), text=True,
                              capture_output=True, timeout=args.tunix_timeout, env=env, cwd=str(real_workload.ROOT))
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-2000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return dict(base, status="failed", error=f"timed out after {args.tunix_timeout} s", stderr_tail=tail)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return dict(base, status="failed", error=f"worker exited {proc.returncode} without a result",
                    stderr_tail=proc.stderr[-4000:])
    res = json.loads(lines[-1])
    for temp, r in (res.get("temperatures") or {}).items():
        r["lengths"] = length_stats(r.pop("lengths_raw"))
    res["temperatures"] = {_tkey(float(t)): r for t, r in (res.get("temperatures") or {}).items()}
    return res


def hf_next_logprobs(model_dir: str, ids: list[int]) -> np.ndarray:
    """transformers' next-token log-probabilities (whole vocabulary) after ``ids``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    return torch.log_softmax(logits, -1).numpy()


def tunix_check(res: dict, work: dict) -> dict | None:
    """Tunix vs transformers on the first prompt's next token: max |log p| difference over Tunix's
    top-20 tokens and the top-1 token, with the rope-theta fix and as shipped."""
    chk = res.get("check")
    if not chk:
        return None
    ref = hf_next_logprobs(work["model_dir"], work["prompt_ids"][0])
    out = dict(transformers_top1=int(ref.argmax()))
    for name in ("fixed", "as_shipped"):
        t = chk[name]
        diff = np.abs(ref[np.asarray(t["ids"])] - np.asarray(t["logprobs"]))
        out[name] = dict(max_abs_logprob_diff=float(diff.max()), top1=int(t["ids"][0]))
    return out


PLAIN, SPEC = "rhyme-jax plain", "rhyme-jax HistoSpec"


def _rhyme_rows(doc) -> dict:
    """``{temperature key: row}`` from rollout_real.json's ``temperatures`` (a list of rows with a
    ``temperature`` key, or a dict keyed by temperature)."""
    temps = doc.get("temperatures", doc.get("rows", []))
    if isinstance(temps, dict):
        return {_tkey(float(t)): dict(r, temperature=float(t)) for t, r in temps.items()}
    return {_tkey(float(r["temperature"])): r for r in temps if "temperature" in r}


def _rhyme_entry(row: dict, kind: str) -> dict | None:
    """One engine of one temperature row: nested ``row[kind]`` (``plain`` / ``spec`` or
    ``histospec``) with ``tokens_per_s`` and ``lengths``, or flat ``<kind>_tokens_per_s`` /
    ``<kind>_lengths``."""
    names = ("plain",) if kind == "plain" else ("spec", "histospec")
    for n in names:
        sub = row.get(n)
        if isinstance(sub, dict) and "tokens_per_s" in sub:
            return dict(tokens_per_s=sub["tokens_per_s"], lengths=sub.get("lengths"),
                        generated_tokens=sub.get("generated_tokens"), seconds=sub.get("seconds"))
        if f"{n}_tokens_per_s" in row:
            return dict(tokens_per_s=row[f"{n}_tokens_per_s"], lengths=row.get(f"{n}_lengths"),
                        generated_tokens=row.get(f"{n}_generated_tokens"), seconds=row.get(f"{n}_seconds"))
    return None


def read_rhyme_report(path: Path, args) -> list[dict]:
    """rhyme-jax plain and HistoSpec rows from ``python -m benchmarks.rollout_real``'s JSON.

    Expected (rollout_real.py as of writing)::

        {"meta": {"max_slots", "dtype", "backend", "rows", "max_new_tokens", ...},
         "temperatures": [{"temperature": T,
                           "plain": {"tokens_per_s", "generated_tokens", "seconds",
                                     "lengths": {"mean", "p50", "p90", "max"}, ...},
                           "spec": {... the same keys ...}, ...}, ...]}

    Also read: ``temperatures`` as a dict keyed by temperature, ``histospec`` for ``spec``, flat
    ``plain_tokens_per_s`` / ``plain_lengths``. Missing file or keys give a row that says so.
    """
    if not path.exists():
        return [dict(engine=e, status="no report", error=f"{path} not found (run python -m benchmarks.rollout_real)")
                for e in (PLAIN, SPEC)]
    try:
        doc = json.loads(path.read_text())
        rows = _rhyme_rows(doc)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return [dict(engine=e, status="unreadable", error=f"{path}: {type(exc).__name__}: {exc}") for e in (PLAIN, SPEC)]
    meta = doc.get("meta", {}) if isinstance(doc, dict) else {}
    settings = {k: meta[k] for k in ("max_slots", "dtype", "backend", "attention_impl", "rows", "max_new_tokens",
                                     "page_size", "jax") if k in meta}
    notes = []
    for key, mine in (("rows", args.prompts * args.samples), ("max_new_tokens", args.max_new_tokens)):
        if key in meta and meta[key] != mine:
            notes.append(f"{key} {meta[key]} there vs {mine} here")
    out = []
    for engine, kind in ((PLAIN, "plain"), (SPEC, "spec")):
        temps = {t: e for t, r in rows.items() if (e := _rhyme_entry(r, kind)) is not None}
        status = "ok" if temps else "unreadable"
        out.append(dict(engine=engine, status=status, settings=dict(settings, source=str(path)), temperatures=temps,
                        mismatch="; ".join(notes) or None,
                        error=None if temps else f"{path}: no '{kind}' tokens_per_s in any temperature row"))
    return out


def _settings_text(eng: dict) -> str:
    s = eng.get("settings") or {}
    keys = ("batch", "max_slots", "dtype", "device", "backend", "torch_threads", "cache_size", "attention_impl")
    parts = [f"{'slots' if k == 'max_slots' else k} {s[k]}" for k in keys if k in s]
    if eng.get("load_avg_1min"):
        parts.append("load {} -> {}".format(*eng["load_avg_1min"]))
    if eng.get("mismatch"):
        parts.append(f"MISMATCH: {eng['mismatch']}")
    return ", ".join(parts)


def _fmt(x, spec="{:.1f}") -> str:
    return "-" if x is None else spec.format(x)


def format_tables(report: dict) -> str:
    """Markdown: one table per temperature, a row per engine; engines without a figure say why."""
    meta = report["meta"]
    lines = ["# Peer rollout engines on the real workload", "",
             " | ".join(f"{k}: {v}" for k, v in meta.items()), ""]
    for temp in meta["temperatures"]:
        t = _tkey(temp)
        lines += [f"## T = {t}", "", "| engine | settings | tokens/s | generated tokens | seconds | "
                  "length mean | p50 | p90 | max |", "|---|---|---|---|---|---|---|---|---|"]
        for eng in report["engines"]:
            r = (eng.get("temperatures") or {}).get(t)
            if eng.get("status") != "ok" or r is None:
                why = eng.get("error") or f"no T={t} in its report"
                lines.append(f"| {eng['engine']} | {_settings_text(eng)} | {eng.get('status', 'n/a')}: {why} "
                             f"| - | - | - | - | - | - |")
                continue
            ln = r.get("lengths") or {}
            lines.append(f"| {eng['engine']} | {_settings_text(eng)} | {_fmt(r['tokens_per_s'])} "
                         f"| {_fmt(r.get('generated_tokens'), '{}')} | {_fmt(r.get('seconds'))} "
                         f"| {_fmt(ln.get('mean'))} | {_fmt(ln.get('p50'), '{:.0f}')} "
                         f"| {_fmt(ln.get('p90'), '{:.0f}')} | {_fmt(ln.get('max'), '{}')} |")
        lines.append("")
    lines += tunix_notes(report)
    return "\n".join(lines) + "\n"


def tunix_notes(report: dict) -> list[str]:
    """The Tunix outcome in words: versions, load/compile time, the logprob check, or the error."""
    eng = next((e for e in report["engines"] if e["engine"] == "Tunix sampler"), None)
    if eng is None:
        return []
    out = ["## Tunix", "", f"status: {eng.get('status')}; versions: {eng.get('versions', 'n/a')}"]
    if eng.get("status") != "ok":
        out.append(f"\nerror: `{eng.get('error')}`")
        if eng.get("traceback") or eng.get("stderr_tail"):
            out += ["", "```", (eng.get("traceback") or eng.get("stderr_tail")).strip()[-3000:], "```"]
        return out
    chk = eng.get("check_vs_transformers")
    if chk:
        out.append(f"\nnext-token check on prompt 0 (vs transformers, top-1 {chk['transformers_top1']}): with "
                   f"rope_theta bound max |dlogp| {chk['fixed']['max_abs_logprob_diff']:.2e} "
                   f"(top-1 {chk['fixed']['top1']}); as shipped (Tunix 0.1.7's Llama3 calls apply_rope "
                   f"with its default theta 1e6) {chk['as_shipped']['max_abs_logprob_diff']:.2e} "
                   f"(top-1 {chk['as_shipped']['top1']}).")
    warm = {t: round(r.get("warmup_s", 0.0), 1) for t, r in (eng.get("temperatures") or {}).items()}
    out.append(f"\nweights load {eng.get('load_s', 0):.1f} s; untimed warm-up (compile + one full call per "
               f"batch shape, per temperature: temperature is static in Tunix's jitted sampling state) {warm} s.")
    return out


def write_report(report: dict, out: Path) -> str:
    """``out``/peers.json and ``out``/peers.md (created); returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps(report, indent=1, default=float))
    text = format_tables(report)
    (out / "peers.md").write_text(text)
    return text


DEFAULTS = real_workload.DEFAULTS  # the benchmarks.rollout_real workload
QUICK = dict(real_workload.QUICK, max_new_tokens=16)
