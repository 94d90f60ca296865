"""A run's saved rollouts read back: the pass replay over its steps and the drafter replay corpus.

* ``pass_replay_run``: ``measure.pass_replay`` over ``<run>/rollouts/step_*.npz`` (issue 4
  analysis; ``python -m benchmarks.pass_replay``): the run's own drafter (its ``spec`` settings,
  ``--set`` overrides) over a history store written back step by step as the trainer writes it,
  or the pass oracle (``oracle_passes``) over the prompt's previous rollout;
* ``draft_gap_run`` / ``cut_bound_run`` / ``occurrence_rules_run``: ``measure.draft_gap`` /
  ``measure.cut_bound`` / ``measure.occurrence_rules`` over the run's steps (``python -m
  benchmarks.draft_gap``, ``--bound``, ``--rules``);
* ``build``: the JSONL corpus that ``python -m rhyme_lab replay-drafts`` and ``benchmarks.replay_peer``
  read (issue 16 scope 4; ``python -m benchmarks.replay_corpus``), one line per target response:
  ``{"prompt": str, "history": [str, ...], "history_rewards": [float, ...], "target": str}``.
  ``history`` of a prompt = its responses in the history steps (in step order, decoded), with
  their rewards; every response of the target steps is one line; ``prompt`` = the run's
  ``model.prompt_template`` applied to the train question of the prompt id. Responses are decoded
  with the tokenizer (special tokens dropped), so a target re-encodes to the sampled tokens up to
  the tokenizer's canonical split. By default the history steps are the run's first epoch and the
  target steps its second; ``max_targets`` keeps a seeded random subset of the target lines.

Both read the run's prompts and epochs through ``rhyme_jax.train`` (``PromptTokens``,
``epoch_of_step``, the run's tokenizer), which ``measure`` may not import: hence here.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

from rhyme_jax.config import load_config
from rhyme_jax.config.loader import schema_fields
from rhyme_jax.data import load_problems
from rhyme_jax.io.rollout_log import list_rollout_steps, load_rollouts
from rhyme_lab.measure import draft_gap, pass_replay
from rhyme_jax.model.tokenizer import Tokenizer
from rhyme_jax.spec.history import HistoryStore
from rhyme_jax.train.prompts import PromptTokens, epoch_of_step


class CorpusError(ValueError):
    """Bad arguments or run directory: no config, a step without saved rollouts, nothing to
    replay or write (message names the option, file or step)."""


def _oracle_step(prompts: dict, pids, responses, history: HistoryStore, max_new: int, window: int):
    """``int64[N]`` oracle passes of one step: sources = the prompt and the prompt + each of its
    responses in ``history``."""
    def sources(p: int) -> list[np.ndarray]:
        hist = history.responses(p)[0] if p in history else []
        return [prompts[p]] + [np.concatenate([prompts[p], h]) for h in hist]

    return np.array([pass_replay.oracle_passes(prompts[int(p)], y, sources(int(p)), max_new, window)
                     for p, y in zip(pids, responses)])


def saved_steps(run, overrides=()):
    """Walk a run's saved steps as the trainer saw them: yields ``(cfg, step, epoch, prompts, pids,
    responses, rewards, history)`` per step (``prompts``: prompt id -> ``int32[p]`` of the step's
    prompts; ``history``: the store as the trainer held it when the step ran, written back after
    the caller is done with the step).

    Raises:
      CorpusError: no ``config.yaml`` in ``run`` (names the path).
    """
    from rhyme_jax.train.policy import build_tokenizer

    run = Path(run)
    if not (run / "config.yaml").is_file():
        raise CorpusError(f"{run / 'config.yaml'}: no such file")
    cfg = load_config(str(run / "config.yaml"), list(overrides))
    train, _ = load_problems(cfg.data)
    tokens = PromptTokens(build_tokenizer(cfg, run, train), train, cfg.model.prompt_template)
    history = HistoryStore(cfg.spec.history_depth)  # written back after each step, as the trainer does
    for step in list_rollout_steps(run):
        ro = load_rollouts(run, step)
        pids, resp, rew = ro["prompt_ids"], ro["responses"], ro["rewards"]
        prompts = {int(p): np.array(tokens(int(p)), np.int32) for p in np.unique(pids)}
        yield cfg, step, epoch_of_step(cfg, len(train), step), prompts, pids, resp, rew, history
        history.update(step, pids, [prompts[int(p)] for p in pids], resp, rew)


def pass_replay_run(run, overrides=(), from_epoch: int = 3, siblings: bool = False, oracle: bool = False,
                    oracle_window: int = 32) -> tuple[dict, list[dict]]:
    """Replay HistoSpec's passes over a run's saved steps of epoch >= ``from_epoch``.

    Args:
      run: run directory with ``config.yaml``, the run's tokenizer and ``rollouts/``.
      overrides: ``KEY=VALUE`` config overrides (e.g. ``spec.window=goodput``).
      siblings: also draft from finished responses of the same step; oracle: ``oracle_passes``
        with at most ``oracle_window`` tokens per pass instead of the drafter.

    Returns ``(summary, rows)``: ``pass_replay.summarize`` of the ``pass_replay.step_row``s.

    Raises:
      CorpusError: no ``config.yaml`` or no saved step of that epoch (names the path).
    """
    rows = []
    for cfg, step, epoch, prompts, pids, resp, rew, history in saved_steps(run, overrides):
        if epoch >= from_epoch:
            max_new = cfg.rollout.max_new_tokens
            if oracle:
                passes = _oracle_step(prompts, pids, resp, history, max_new, oracle_window)
            else:
                passes = pass_replay.replay_step(cfg.spec, max_new, prompts, pids, resp, rew, history, siblings)
            rows.append(pass_replay.step_row(step, epoch, resp, passes))
    if not rows:
        raise CorpusError(f"no steps of epoch >= {from_epoch} in {run}")
    return {"run": str(run), "siblings": siblings, "oracle": oracle, **pass_replay.summarize(rows)}, rows


def draft_gap_run(run, overrides=(), from_epoch: int = 2, cost=None) -> dict[int, dict]:
    """``measure.draft_gap.gap_step`` over a run's saved steps, merged per epoch (epochs >=
    ``from_epoch``): ``{epoch: merged gap}``. One ``Drafter`` drafts every step, the earlier
    epochs too, so its calibration learns over the run as the engine's does. With ``cost`` (a
    ``PassCost``, e.g. the run's own profile) each pass sends what the engine's allocation would
    (``draft_replay.EnginePasses`` over the run's shape plan; pages and backoff not simulated),
    else every drafted token.

    Raises:
      CorpusError: no ``config.yaml`` or no saved step of that epoch (names the path).
    """
    from rhyme_lab.measure.draft_replay import EnginePasses
    from rhyme_jax.rollout.shapes import plan_from_config
    from rhyme_jax.spec.drafter import Drafter

    steps: dict[int, list[dict]] = {}
    drafter = None  # one for the run, as the trainer keeps one: its calibration learns over the steps
    try:
        for cfg, _step, epoch, prompts, pids, resp, rew, history in saved_steps(run, overrides):
            drafter = drafter or Drafter(cfg.spec, history)
            r = cfg.rollout
            send = None if cost is None else EnginePasses(plan_from_config(cfg), cost)
            gap = draft_gap.gap_step(cfg.spec, r.max_new_tokens, prompts, pids, resp, rew, history, send=send,
                                     drafter=drafter)
            if epoch >= from_epoch:
                steps.setdefault(epoch, []).append(gap)
    finally:
        if drafter is not None:
            drafter.close()
    if not steps:
        raise CorpusError(f"no steps of epoch >= {from_epoch} in {run}")
    return {ep: draft_gap.merge(st) for ep, st in sorted(steps.items())}


def cut_bound_run(run, cost, overrides=(), from_epoch: int = 2, cross: bool = False) -> dict[int, dict]:
    """``measure.cut_bound.bound_step`` over a run's saved steps under the pass-cost model
    ``cost`` (e.g. the run's own profile), merged per epoch (epochs >= ``from_epoch``): ``{epoch:
    merged}``. One ``Drafter`` per mode drafts every step, the earlier epochs too (its calibration
    learns over the run as the engine's does). Where the run has ``policy_modes/`` (the policy's
    argmax at every response position, ``measure.policy_mode``), its ``POLICY_MODES`` too;
    with ``cross``, the oracle over other prompts' text too (``CROSS_MODE``).

    Raises:
      CorpusError: no ``config.yaml`` or no saved step of that epoch (names the path).
      PolicyModeError: a step's modes are missing or do not fit its rollouts (names the file).
    """
    from rhyme_lab.measure import cut_bound
    from rhyme_lab.measure.policy_mode import MODES_DIR, load_modes
    from rhyme_jax.rollout.shapes import plan_from_config
    from rhyme_jax.spec.drafter import Drafter

    steps: dict[int, list[dict]] = {}
    drafters: dict = {}
    policy = (Path(run) / MODES_DIR).is_dir()
    try:
        for cfg, step, epoch, prompts, pids, resp, rew, history in saved_steps(run, overrides):
            drafters = drafters or {m: Drafter(cfg.spec, history) for m in ("estimates", "known")}
            modes = load_modes(run, step, resp) if policy else None
            got = cut_bound.bound_step(cfg.rollout.max_new_tokens, prompts, pids, resp, rew, history,
                                       plan_from_config(cfg), cost, drafters, modes, cross)
            if epoch >= from_epoch:
                steps.setdefault(epoch, []).append(got)
    finally:
        for d in drafters.values():
            d.close()
    if not steps:
        raise CorpusError(f"no steps of epoch >= {from_epoch} in {run}")
    return {ep: cut_bound.merge(st) for ep, st in sorted(steps.items())}


def occurrence_rules_run(run, overrides=(), from_epoch: int = 2) -> dict[int, dict]:
    """``measure.occurrence_rules.rules_step`` over a run's saved steps of epoch >=
    ``from_epoch``, summed per epoch: ``{epoch: {rule: {"passes", "carried", "tokens"}}}``.

    Raises:
      CorpusError: no ``config.yaml`` or no saved step of that epoch (names the path).
    """
    from rhyme_lab.measure import occurrence_rules

    out: dict[int, dict] = {}
    for _cfg, _step, epoch, prompts, pids, resp, _rew, history in saved_steps(run, overrides):
        if epoch < from_epoch:
            continue
        got = occurrence_rules.rules_step(prompts, pids, resp, history)
        total = out.setdefault(epoch, {r: {"passes": 0, "carried": 0, "tokens": 0} for r in got})
        for r, v in got.items():
            for k in v:
                total[r][k] += v[k]
    if not out:
        raise CorpusError(f"no steps of epoch >= {from_epoch} in {run}")
    return dict(sorted(out.items()))


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
        print(f"replay corpus: {path}: ignoring keys this schema does not know: {dropped}", file=sys.stderr)
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


def write_corpus(path: Path, lines: list[dict]) -> str:
    """Write the corpus ``lines`` (``build``) to ``path`` as JSONL (parent folders made); returns
    a one-line summary (targets, how many with history, megabytes)."""
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    n_hist = sum(bool(line["history"]) for line in lines)
    return f"{path}: {len(lines)} targets ({n_hist} with history), {path.stat().st_size / 1e6:.2f} MB"
