"""``python -m rhyme_lab analyze RUN_DIR``: how much do a run's rollouts rhyme across epochs?

RhymeRL (arXiv 2508.18588) s.3 observations, measured on a run's saved rollouts
(``<run>/rollouts/step_*.npz``, ``io/rollout_log.py``). The epoch of a prompt at a step is how
many times it has been rolled out up to and including that step; for every epoch e >= 2:

* O5 "rhyme": share of epoch-e response tokens a HistoSpec drafter over the prompt's previous
  rollout predicts. Teacher-forced simulation per response: at position i draft with the window
  policy (default aimd, cap 32) and the draft rule of ``suffix_index.py`` (at most the L - i
  tokens left), accept a = the longest common prefix of the draft with the actual tokens from i,
  count a tokens as predicted, update the window, advance i by a + 1. Paper: 75-95%.
* O6: share of prompts whose length rank moves by more than ``rank_shift`` (0.1, a decile) vs
  their previous rollout. Length rank = percentile of the prompt's mean response length among the
  prompts of its step: (number of prompts with a smaller mean + half the number of others with
  an equal mean) / (P - 1), 0.5 when P = 1. Paper: 2-4%.

Prompts are not stored in the rollout logs, so each prompt's index holds its previous responses
behind a synthetic 5-token prompt (ids 2**31-5 .. 2**31-1, outside any vocabulary) standing for
the prompt's last five tokens: the first response tokens can be drafted as in the engine, but
occurrences inside the real prompt text are not indexed.

Outputs: a table on the terminal, ``<run>/analysis.md``, ``<run>/analysis.json`` and
``<run>/analysis.png``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from rhyme_jax.config.sections import SpecSection
from rhyme_jax.spec.suffix_index import IndexPack, SuffixIndex, draft_batch
from rhyme_jax.spec.window import initial_window, next_window
from rhyme_jax.io.atomic import atomic_write
from rhyme_jax.io.rollout_log import list_rollout_steps, load_rollouts

MARKER = np.arange(2**31 - 5, 2**31, dtype=np.int64).astype(np.int32)  # synthetic prompt tail
PAPER = {"o5": (0.75, 0.95), "o6": (0.02, 0.04)}


class AnalyzeError(ValueError):
    """The run directory has no rollouts, or no prompt was rolled out twice."""


def simulate_rhyme(
    pack: IndexPack, slots: np.ndarray, responses: list[np.ndarray], *, branch: str = SpecSection.branch,
    window: str = SpecSection.window, fixed_window: int = SpecSection.fixed_window,
    min_token_prob: float = SpecSection.min_token_prob, pattern_max: int = SpecSection.pattern_max,
    pattern_min: int = SpecSection.pattern_min,
) -> np.ndarray:
    """Teacher-forced drafting of many responses at once (O5; see module docstring).

    Args:
      pack: indexes of the previous rollouts (``IndexPack.of``), built with ``MARKER`` as prompt.
      slots: ``int[B]`` pack slot of each response (-1: no history, nothing predicted).
      responses: B actual ``int[L_b]`` token arrays.
      branch, window, fixed_window, min_token_prob, pattern_max, pattern_min: drafting settings,
        as the ``spec`` config keys of the same names (defaults: ``SpecSection``'s, the paper's).

    Returns:
      ``int64[B]`` predicted (accepted) tokens per response.

    Raises:
      ValueError: an unknown ``branch`` / ``window`` or out-of-range settings (``draft_batch``,
        ``initial_window``).
    """
    b = len(responses)
    lengths = np.array([r.size for r in responses], dtype=np.int64)
    h, lmax = MARKER.size, int(lengths.max(initial=0))
    buf = np.full((b, h + lmax + 1), -1, np.int32)  # marker + response, -1 beyond the end
    buf[:, :h] = MARKER
    for i, r in enumerate(responses):
        buf[i, h:h + r.size] = r
    pos = np.zeros(b, np.int64)
    predicted = np.zeros(b, np.int64)
    win = initial_window(window, b, fixed_window)
    back = np.arange(-pattern_max, 0)
    rows = np.flatnonzero(pos < lengths)
    while rows.size:
        cur = h + pos[rows]
        cols = cur[:, None] + back
        tails = np.where(cols >= 0, buf[rows[:, None], np.maximum(cols, 0)], -1)
        max_lens = np.minimum(win[rows], lengths[rows] - pos[rows])
        drafts, lens = draft_batch(pack, slots[rows], tails, max_lens, branch=branch,
                                   min_token_prob=min_token_prob, pattern_max=pattern_max,
                                   pattern_min=pattern_min)
        w = drafts.shape[1]
        actual = buf[rows[:, None], np.minimum(cur[:, None] + np.arange(w), buf.shape[1] - 1)]
        match = (drafts == actual) & (np.arange(w) < lens[:, None])
        acc = np.cumprod(match, axis=1).sum(axis=1)
        predicted[rows] += acc
        win[rows] = next_window(window, win[rows], lens, acc, fixed_window)
        pos[rows] += acc + 1
        rows = rows[pos[rows] < lengths[rows]]
    return predicted


def length_percentiles(mean_lengths: np.ndarray) -> np.ndarray:
    """``float64[P]`` length rank of each prompt (module docstring): average 0-based rank / (P-1)."""
    m = np.asarray(mean_lengths, dtype=np.float64)
    p = m.size
    if p <= 1:
        return np.full(p, 0.5)
    s = np.sort(m)
    below = np.searchsorted(s, m, side="left")
    equal = np.searchsorted(s, m, side="right") - below - 1
    return (below + 0.5 * equal) / (p - 1)


def analyze(run_dir: str | Path, *, branch: str = SpecSection.branch, window: str = SpecSection.window,
            fixed_window: int = SpecSection.fixed_window, min_token_prob: float = SpecSection.min_token_prob,
            pattern_max: int = SpecSection.pattern_max, pattern_min: int = SpecSection.pattern_min,
            rank_shift: float = 0.1) -> dict:
    """O5/O6 per epoch from a run's saved rollouts (module docstring).

    Args:
      run_dir: run directory holding ``rollouts/step_*.npz``.
      branch, window, fixed_window, min_token_prob, pattern_max, pattern_min: drafting settings
        of the simulated drafter, as in ``simulate_rhyme``.
      rank_shift: length-rank change that counts as a shift (O6).

    Returns:
      ``{"settings": {...}, "epochs": [{"epoch", "prompts", "responses", "tokens", "predicted",
      "rhyme", "rank_moved", "rank_shift_share", "steps"}], "overall": {...}}`` with epochs >= 2.

    Raises:
      AnalyzeError: no rollouts in ``run_dir``, or no prompt rolled out twice.
      RolloutLogError: a corrupt rollout file.
    """
    run_dir = Path(run_dir)
    steps = list_rollout_steps(run_dir)
    if not steps:
        raise AnalyzeError(f"{run_dir}: no saved rollouts (expected rollouts/step_*.npz)")
    kw = dict(branch=branch, window=window, fixed_window=fixed_window, min_token_prob=min_token_prob,
              pattern_max=pattern_max, pattern_min=pattern_min)
    seen: dict[int, int] = {}  # prompt id -> rollouts so far
    prev: dict[int, tuple[list, np.ndarray, float]] = {}  # last rollout: responses, rewards, pct
    epochs: dict[int, dict] = {}
    for step in steps:
        d = load_rollouts(run_dir, step)
        groups: dict[int, list[int]] = {}
        for i, pid in enumerate(d["prompt_ids"].tolist()):
            groups.setdefault(int(pid), []).append(i)
        pids = list(groups)
        pct = length_percentiles([d["lengths"][groups[p]].mean() for p in pids])
        indexes, slots, resp, owner = [], [], [], []
        for k, pid in enumerate(pids):
            seen[pid] = seen.get(pid, 0) + 1
            if pid not in prev:
                continue
            e = epochs.setdefault(seen[pid], dict(epoch=seen[pid], prompts=0, responses=0, tokens=0,
                                                  predicted=0, rank_moved=0, steps=set()))
            e["prompts"] += 1
            e["rank_moved"] += int(abs(pct[k] - prev[pid][2]) > rank_shift)
            e["steps"].add(step)
            indexes.append(SuffixIndex.build(MARKER, prev[pid][0], prev[pid][1]))
            for i in groups[pid]:
                slots.append(len(indexes) - 1)
                resp.append(d["responses"][i])
                owner.append(seen[pid])
        if resp:
            got = simulate_rhyme(IndexPack.of(indexes), np.array(slots), resp, **kw)
            for r, g, ep in zip(resp, got, owner):
                epochs[ep]["responses"] += 1
                epochs[ep]["tokens"] += int(r.size)
                epochs[ep]["predicted"] += int(g)
        for k, pid in enumerate(pids):
            prev[pid] = ([d["responses"][i] for i in groups[pid]], d["rewards"][groups[pid]], pct[k])
    if not epochs:
        raise AnalyzeError(f"{run_dir}: no prompt was rolled out twice ({len(steps)} step(s)); "
                           f"O5/O6 need epoch >= 2")
    rows = []
    for ep in sorted(epochs):
        e = epochs[ep]
        e["steps"] = sorted(e["steps"])
        e["rhyme"] = e["predicted"] / e["tokens"] if e["tokens"] else float("nan")
        e["rank_shift_share"] = e["rank_moved"] / e["prompts"]
        rows.append(e)
    tot = {k: sum(e[k] for e in rows) for k in ("prompts", "responses", "tokens", "predicted", "rank_moved")}
    tot["rhyme"] = tot["predicted"] / tot["tokens"] if tot["tokens"] else float("nan")
    tot["rank_shift_share"] = tot["rank_moved"] / tot["prompts"]
    return {"settings": dict(kw, rank_shift=rank_shift, steps=len(steps),
                             index="previous rollout's responses behind a synthetic 5-token prompt"),
            "epochs": rows, "overall": tot}


def format_table(result: dict) -> str:
    """Markdown table of ``analyze``'s result (one row per epoch, then all epochs)."""
    lines = ["| epoch | prompts | responses | tokens | O5 rhyme (predicted share) | O6 rank moved > "
             f"{result['settings']['rank_shift']:g} |", "|---|---|---|---|---|---|"]
    for e in result["epochs"] + [dict(result["overall"], epoch="all")]:
        lines.append(f"| {e['epoch']} | {e['prompts']} | {e['responses']} | {e['tokens']} | "
                     f"{e['rhyme']:.1%} | {e['rank_shift_share']:.1%} ({e['rank_moved']}) |")
    return "\n".join(lines)


def _plot(result: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    xs = [e["epoch"] for e in result["epochs"]]
    for j, (key, name, col) in enumerate((("rhyme", "O5: share of tokens predicted", "o5"),
                                          ("rank_shift_share", "O6: share of prompts with a large "
                                           "length-rank shift", "o6"))):
        ax = fig.add_subplot(1, 2, j + 1)
        ax.plot(xs, [e[key] for e in result["epochs"]], marker="o", label="this run")
        ax.axhspan(*PAPER[col], color="tab:green", alpha=0.2, label="paper")
        ax.set_title(name, fontsize="medium")
        ax.set_xlabel("epoch (rollouts of the prompt so far)")
        ax.set_ylim(0, 1)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    with atomic_write(path, "wb") as fh:
        fig.savefig(fh, format="png", dpi=100)


def write_analysis(run_dir: str | Path, result: dict) -> dict[str, Path]:
    """Write ``analysis.md``, ``analysis.json`` and ``analysis.png`` into ``run_dir`` (atomically);
    returns their paths by kind."""
    run_dir = Path(run_dir)
    paths = {k: run_dir / f"analysis.{k}" for k in ("md", "json", "png")}
    s = result["settings"]
    md = (f"# Rollout rhyme analysis\n\nRhymeRL O5/O6 from {s['steps']} saved rollout steps. Drafter: "
          f"branch={s['branch']}, window={s['window']}, min_token_prob={s['min_token_prob']}, "
          f"pattern {s['pattern_max']}..{s['pattern_min']}; index: {s['index']}.\n"
          f"Paper: O5 75-95%, O6 2-4%.\n\n{format_table(result)}\n")
    with atomic_write(paths["md"], "w") as fh:
        fh.write(md)
    def finite(x):  # NaN (no tokens in an epoch) -> null: strict JSON
        return None if isinstance(x, float) and x != x else x

    clean = dict(result, epochs=[{k: finite(v) for k, v in e.items()} for e in result["epochs"]],
                 overall={k: finite(v) for k, v in result["overall"].items()})
    with atomic_write(paths["json"], "w") as fh:
        json.dump(clean, fh, indent=2)
    _plot(result, paths["png"])
    return paths
