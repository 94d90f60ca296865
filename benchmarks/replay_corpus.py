"""A drafter replay corpus from a training run's saved rollouts (issue 16 scope 4).

Writes the JSONL that ``rhyme-jax replay-drafts`` and ``benchmarks/replay_peer.py`` read, one line
per target response: ``{"prompt": str, "history": [str, ...], "history_rewards": [float, ...],
"target": str}``. From ``RUN_DIR/rollouts/step_*.npz`` (``rhyme_jax.io.rollout_log``):

* ``history`` of a prompt = its responses in the history steps (in step order, as decoded text),
  with their rewards;
* every response of the target steps is one line, with the history of its prompt (prompts with no
  history in those steps get an empty one);
* ``prompt`` = the run's ``model.prompt_template`` applied to the train question of the prompt id
  (the text whose token ids the run fed the model; the rollouts store only the prompt id).

Responses are decoded with the tokenizer (special tokens such as the end marker dropped), so a
target re-encodes to the sampled tokens up to the tokenizer's canonical split. By default the
history steps are the run's first epoch and the target steps its second (``grpo.prompts_per_step``,
``grpo.num_prompts``); ``--max-targets`` keeps a seeded random subset of the target lines, in order.

    python benchmarks/replay_corpus.py /tmp/smol/runs/gsm8k_smollm2_135m \
        --tokenizer ~/.cache/rhyme_jax/models/smollm2-135m-instruct --out /tmp/corpora/smollm2.jsonl \
        --history-steps 1-2 --target-steps 3-4
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rhyme_jax.config import load_config  # noqa: E402
from rhyme_jax.config.loader import schema_fields  # noqa: E402
from rhyme_jax.data import load_problems  # noqa: E402
from rhyme_jax.io.rollout_log import list_rollout_steps, load_rollouts  # noqa: E402
from rhyme_jax.model.tokenizer import Tokenizer  # noqa: E402
from rhyme_jax.train.prompts import epoch_of_step  # noqa: E402


class CorpusError(ValueError):
    """Bad arguments or run directory (message names the option, file or step)."""


def parse_steps(text: str, option: str) -> list[int]:
    """``"a-b"`` (inclusive) or ``"a"`` -> ``[a, ..., b]``.

    Raises:
      CorpusError: not of that form, a step < 1 or b < a (names ``option``).
    """
    try:
        lo, _, hi = text.partition("-")
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise CorpusError(f"{option}: expected 'a-b' or 'a', got {text!r}") from None
    if a < 1 or b < a:
        raise CorpusError(f"{option}: need 1 <= a <= b, got {text!r}")
    return list(range(a, b + 1))


def load_run_config(path: Path, overrides=()):
    """The run's saved ``config.yaml`` as a ``RunConfig``, keys this version of the schema does not
    know (a run saved by another version) dropped and named on stderr.

    Raises:
      CorpusError: no such file or not YAML. rhyme_jax.config.ConfigError: a bad value.
    """
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise CorpusError(f"{path}: unreadable run config ({exc})") from None
    if not isinstance(raw, dict):
        raise CorpusError(f"{path}: not a YAML mapping")
    known, dropped = set(schema_fields()), []

    def prune(node, prefix):
        out = {}
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict) and any(f.startswith(name + ".") for f in known):
                out[key] = prune(value, name + ".")
            elif name in known:
                out[key] = value
            else:
                dropped.append(name)
        return out

    pruned = prune(raw, "")
    if dropped:
        print(f"replay_corpus.py: {path}: ignoring keys this schema does not know: {dropped}", file=sys.stderr)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as fh:
        yaml.safe_dump(pruned, fh)
        fh.flush()
        return load_config(fh.name, list(overrides))


def default_steps(cfg, num_train: int, saved: list[int]) -> tuple[list[int], list[int]]:
    """The saved steps of the run's first epoch (history) and of its second (targets)."""
    epoch = {s: epoch_of_step(cfg, num_train, s) for s in saved}
    return [s for s in saved if epoch[s] == 1], [s for s in saved if epoch[s] == 2]


def _prompt_texts(cfg, tok: Tokenizer, train, pids) -> dict[int, str]:
    """Prompt text per train prompt id: ``model.prompt_template`` on its question, the text the run
    encoded (``rhyme_jax.train.prompts.PromptTokens``; decoding its ids instead would drop the chat
    markers, which decoding skips as special tokens).

    Raises:
      CorpusError: a prompt id outside the train split of the run's data config.
    """
    out = {}
    for pid in sorted({int(p) for p in pids}):
        if not 0 <= pid < len(train):
            raise CorpusError(f"prompt id {pid} is outside the {len(train)} train problems of the run's data config")
        out[pid] = tok.format_prompt(cfg.model.prompt_template, train[pid].question)
    return out


def build(run_dir: Path, tok: Tokenizer, *, history_steps=None, target_steps=None, max_targets: int = 0,
          seed: int = 0, overrides=()) -> list[dict]:
    """The corpus lines (see the module docstring).

    Args:
      run_dir: a run directory holding ``config.yaml`` and ``rollouts/step_*.npz``.
      tok: the run's tokenizer.
      history_steps, target_steps: step numbers (``None``: the run's first and second epoch).
      max_targets: keep at most this many target lines (seeded random subset, order kept); 0 = all.
      overrides: ``KEY=VALUE`` config overrides (e.g. ``data.train_path=...``).

    Raises:
      CorpusError: no config, a step without saved rollouts, no target lines.
      rhyme_jax.io.rollout_log.RolloutLogError, rhyme_jax.config.ConfigError,
      rhyme_jax.data.DataError: from the loaders (they name the file or field).
    """
    cfg_path = Path(run_dir) / "config.yaml"
    if not cfg_path.is_file():
        raise CorpusError(f"{cfg_path}: no run config")
    cfg = load_run_config(cfg_path, overrides)
    train, _ = load_problems(cfg.data)
    saved = list_rollout_steps(run_dir)
    if history_steps is None or target_steps is None:
        h, t = default_steps(cfg, len(train), saved)
        history_steps = h if history_steps is None else history_steps
        target_steps = t if target_steps is None else target_steps
    for s in [*history_steps, *target_steps]:
        if s not in saved:
            raise CorpusError(f"{run_dir}: no rollouts saved for step {s} (saved: {saved[:3]}..{saved[-3:]})")
    history: dict[int, list[tuple[str, float]]] = {}
    for s in history_steps:
        r = load_rollouts(run_dir, s)
        for pid, resp, reward in zip(r["prompt_ids"], r["responses"], r["rewards"]):
            history.setdefault(int(pid), []).append((tok.decode(resp), float(reward)))
    targets = []
    for s in target_steps:
        r = load_rollouts(run_dir, s)
        targets += [(int(pid), tok.decode(resp)) for pid, resp in zip(r["prompt_ids"], r["responses"])]
    targets = [(pid, text) for pid, text in targets if tok.encode(text)]  # an empty response has no target
    if max_targets and len(targets) > max_targets:
        keep = np.sort(np.random.default_rng(seed).choice(len(targets), max_targets, replace=False))
        targets = [targets[i] for i in keep]
    if not targets:
        raise CorpusError(f"{run_dir}: no non-empty responses in target steps {target_steps}")
    prompts = _prompt_texts(cfg, tok, train, [pid for pid, _ in targets])
    return [{"prompt": prompts[pid], "history": [h for h, _ in history.get(pid, [])],
             "history_rewards": [w for _, w in history.get(pid, [])], "target": text}
            for pid, text in targets]


def main(argv=None) -> int:
    """Command line (see the module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--tokenizer", required=True, help="tokenizer.json or a directory holding one")
    ap.add_argument("--out", required=True, type=Path, help="JSONL file to write")
    ap.add_argument("--history-steps", help="a-b: steps whose responses are the history (default: epoch 1)")
    ap.add_argument("--target-steps", help="c-d: steps whose responses are the targets (default: epoch 2)")
    ap.add_argument("--max-targets", type=int, default=0, help="seeded random subset of targets (0 = all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field of the run's config.yaml (e.g. data.train_path=...)")
    args = ap.parse_args(argv)
    try:
        hist = parse_steps(args.history_steps, "--history-steps") if args.history_steps else None
        tgt = parse_steps(args.target_steps, "--target-steps") if args.target_steps else None
        tok = Tokenizer.from_file(args.tokenizer)
        lines = build(args.run_dir, tok, history_steps=hist, target_steps=tgt, max_targets=args.max_targets,
                      seed=args.seed, overrides=args.overrides)
    except (ValueError, OSError) as exc:  # CorpusError, ConfigError, DataError, RolloutLogError, TokenizerError
        print(f"replay_corpus.py: {exc}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    n_hist = sum(bool(line["history"]) for line in lines)
    print(f"{args.out}: {len(lines)} targets ({n_hist} with history), {args.out.stat().st_size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
