"""The paper's ablation ids (docs/reproduction.md), the runs (units) they need, and the scales.

Every id names the paper's figure (RhymeRL, arXiv 2508.18588, s.6 evaluation; K-ids are this
project's knobs, with the paper's or the released specRL code's choice where they made one) and
the units whose outputs its figures come from. Units are defined by a config file under
``configs/ablations`` (the full CPU scale, as ``rhyme-jax train --config`` would run it) plus the
overrides of a scale: ``quick`` (``python -m rhyme_lab ablate SUITE --quick``: minutes on 2 CPU cores) and
``tiny`` (the tests: seconds, a tiny model everywhere); ``gpu`` takes the same units from
``configs/ablations/gpu`` (a real model on accelerators, docs/reproduction.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (configs/ lives here)
ABLATION_DIR = "configs/ablations"


class AblationError(ValueError):
    """An unknown suite, id, unit or scale (the message lists the known ones)."""


@dataclass(frozen=True)
class Unit:
    """One run several ids draw on; its process writes ``units/<name>.json``.

    Attributes:
      name: file stem of its outputs.
      kind: ``sft`` (demo warm start), ``e2e`` (GRPO steps on the rollout workers of the config,
        timed end to end), ``paired`` (GRPO steps, each rollout generated plain and with HistoSpec
        on the same weights, prompts and key) or ``session`` (rollouts of one fixed policy over
        epochs: plain, live HistoSpec and the sweeps of the scale's ``SessionPlan``).
      config: YAML under ``configs/ablations`` (repository-relative).
      devices: CPU devices the process is given (fake host devices: 4 rollout workers need 4; the
        paired run takes the same 8 as the end-to-end runs, so their compiled programs are its).
      needs: units whose outputs it starts from (``demo_sft``: params and tokenizer).
      what: one line for ``--list``.
      oracle: for a paired kind, the oracle drafter of the second rollout (``paired.ORACLES``;
        ``""``: the config's drafter).
      twin: for kind ``learn_twin``, the ``sched.mode`` of the twin placement every rollout also
        gets (``paired_placement``).
      held_out: a GRPO unit also evaluates greedy held-out accuracy before and after its steps
        (per problem, the run's ``eval/``; untimed), for its paired gain.
    """

    name: str
    kind: str
    config: str
    devices: int = 1
    needs: tuple[str, ...] = ()
    what: str = ""
    oracle: str = ""
    twin: str = ""
    held_out: bool = False


@dataclass(frozen=True)
class Ablation:
    """One ablation id (docs/reproduction.md).

    Attributes:
      id: ``A1`` ... ``O6``.
      varied: what changes between the compared runs.
      measured: the figure reported.
      paper: the paper's figure (or the choice it / the specRL code made), as text.
      units: the units the figures come from.
      sweep: ``(config key, values)`` varied on top of the unit's config, if any.
    """

    id: str
    varied: str
    measured: str
    paper: str
    units: tuple[str, ...]
    sweep: tuple[str, tuple] = ()

    def configs(self) -> list[str]:
        """The config files of its units, in order, without repeats."""
        return list(dict.fromkeys(UNITS[u].config for u in self.units))


def _cfg(stem: str) -> str:
    return f"{ABLATION_DIR}/{stem}.yaml"


UNITS: dict[str, Unit] = {u.name: u for u in (
    Unit("demo_sft", "sft", _cfg("e2e_fifo"), what="SFT warm start of the demo model (params + tokenizer)"),
    Unit("e2e_fifo", "e2e", _cfg("e2e_fifo"), 8, ("demo_sft",),
         "GRPO, 4 rollout workers, fifo placement, plain decode (the baseline)"),
    Unit("e2e_tier1_migration", "e2e", _cfg("e2e_histopipe_tier1_migration"), 8, ("demo_sft",),
         "GRPO, 4 workers, HistoPipe tier 1 + tail migration, plain decode"),
    Unit("e2e_tier12_migration", "e2e", _cfg("e2e_histopipe_tier12_migration"), 8, ("demo_sft",),
         "GRPO, 4 workers, HistoPipe tier 1 + tier 2 + migration, plain decode"),
    Unit("e2e_histospec", "e2e", _cfg("e2e_histopipe_histospec"), 8, ("demo_sft",),
         "GRPO, 4 workers, full HistoPipe + HistoSpec (paper drafter)"),
    Unit("demo_paired", "paired", _cfg("histospec_per_step"), 8, ("demo_sft",),
         "GRPO, 1 worker, every rollout plain and HistoSpec on the same weights/prompts/key"),
    Unit("real_session", "session", _cfg("histospec_real"),
         what="SmolLM2-135M-Instruct on GSM8K: plain epochs, live HistoSpec, temperature and batch sweeps"),
    Unit("learn_plain", "learn", _cfg("learn_plain"), 1, ("demo_sft",),
         "GRPO learning run of the demo, prompts recurring each 10 steps, sync, plain decode"),
    Unit("learn_aimd", "learn", _cfg("learn_aimd"), 1, ("demo_sft",), "learn_plain + HistoSpec, paper drafter (AIMD)"),
    Unit("learn_goodput", "learn", _cfg("learn_goodput"), 1, ("demo_sft",),
         "learn_plain + HistoSpec, goodput drafter"),
    Unit("learn_goodput_paired", "learn_paired", _cfg("learn_goodput"), 1, ("demo_sft",),
         "learn_goodput with every rollout also decoded plain just before it (same weights, prompts, key)"),
    Unit("learn_oracle_paired", "learn_paired", _cfg("learn_goodput"), 1, ("demo_sft",),
         "learn_goodput_paired with the source-bound oracle drafter (knows which tokens its sources hold)",
         oracle="sources"),
    Unit("learn_one_step_off", "learn", _cfg("learn_one_step_off"), 1, ("demo_sft",),
         "learn_plain with rollout s+1 overlapping update s (staleness 1)"),
    Unit("learn_cross_step", "learn", _cfg("learn_cross_step"), 1, ("demo_sft",),
         "learn_one_step_off with per-worker cross-step queues"),
    Unit("learn_workers_fifo", "learn", _cfg("learn_workers_fifo"), 8, ("demo_sft",),
         "learn_plain on 4 rollout workers, fifo placement"),
    Unit("learn_workers_histopipe", "learn", _cfg("learn_workers_histopipe"), 8, ("demo_sft",),
         "learn_workers_fifo with HistoPipe tiers 1 + 2 and tail migration"),
    Unit("learn_workers_paired", "learn_twin", _cfg("learn_workers_histopipe"), 8, ("demo_sft",),
         "learn_workers_histopipe with every rollout also placed fifo, back to back (same weights, prompts, key)",
         twin="fifo"),
    Unit("longtail_sft", "sft", _cfg("longtail_goodput"),
         what="SFT warm start on the ledger task (configs/longtail.yaml: packed, problems up to 512 tokens)"),
    Unit("longtail_goodput_paired", "learn_paired", _cfg("longtail_goodput"), 1, ("longtail_sft",),
         "GRPO on the ledger task (4,096 new tokens, long tail), every rollout plain and with HistoSpec back to back"),
    Unit("longtail_plain_seed0", "learn", _cfg("longtail_plain_seed0"), 1, ("longtail_sft",),
         "the ledger task's GRPO, HistoSpec off (its tokens: the paired unit's), held-out gain on 400 problems",
         held_out=True),
    Unit("longtail_plain_seed1", "learn", _cfg("longtail_plain_seed1"), 1, ("longtail_sft",),
         "longtail_plain_seed0 with run seed 1 (the second learning seed)", held_out=True),
    Unit("longtail_plain_long", "learn", _cfg("longtail_plain_long"), 1, ("longtail_sft",),
         "longtail_plain_seed0 for 48 steps over 384 prompts seen once (run by hand)", held_out=True),
    Unit("longtail_plain_long_seed1", "learn", _cfg("longtail_plain_long_seed1"), 1, ("longtail_sft",),
         "longtail_plain_long with run seed 1 (run by hand)", held_out=True),
    Unit("longtail_recur_paired", "learn_paired", _cfg("longtail_recur"), 1, ("longtail_sft",),
         "48 steps over 192 prompts seen twice, every rollout plain and with HistoSpec, held-out gain on 400 problems"
         " (run by hand)", held_out=True),
    Unit("longtail_recur_seed1_paired", "learn_paired", _cfg("longtail_recur_seed1"), 1, ("longtail_sft",),
         "longtail_recur_paired with run seed 1 (L6's second seed, run by hand)", held_out=True),
    Unit("longtail_bound_paired", "learn_paired", _cfg("longtail_bound"), 1, ("longtail_sft",),
         "4 steps of the ledger task's GRPO, every rollout plain, with HistoSpec and with the always-right oracle",
         oracle="always-right"),
    Unit("longtail_smollm2_paired", "learn_real_paired", _cfg("longtail_smollm2"),
         what="SmolLM2-135M-Instruct on GSM8K with 1,024 new tokens, 4 steps, every rollout plain and with HistoSpec"),
    Unit("learn_real_plain", "learn_real", _cfg("learn_real_plain"),
         what="SmolLM2-135M-Instruct arithmetic recipe, prompts recurring each 4 steps, plain decode"),
    Unit("learn_real_aimd", "learn_real", _cfg("learn_real_aimd"), what="learn_real_plain + HistoSpec (AIMD)"),
    Unit("learn_real_goodput", "learn_real", _cfg("learn_real_goodput"),
         what="learn_real_plain + HistoSpec (goodput)"),
    Unit("learn_real_goodput_paired", "learn_real_paired", _cfg("learn_real_goodput"),
         what="learn_real_goodput with every rollout also decoded plain just before it"),
    Unit("learn_real_oracle_paired", "learn_real_paired", _cfg("learn_real_goodput"),
         what="learn_real_goodput_paired with the source-bound oracle drafter", oracle="sources"),
)}

LEARN_KINDS = ("learn", "learn_paired", "learn_real", "learn_real_paired", "learn_twin")  # GRPO learning runs (suite `learning`): same configs at every scale but tiny

LEARN_WARM_STARTS = ("longtail_sft",)  # sft units of a learning suite: their config at every scale, as LEARN_KINDS

_E2E = ("e2e_fifo", "e2e_tier1_migration", "e2e_tier12_migration", "e2e_histospec")

ABLATIONS: dict[str, Ablation] = {a.id: a for a in (
    Ablation("A1", "+ HistoPipe (tier 1 + migration) vs fifo", "end-to-end throughput (tokens/s)",
             "1.43x (Math-14B)", ("e2e_fifo", "e2e_tier1_migration")),
    Ablation("A2", "+ tier-2 allocation", "end-to-end throughput", "x1.10 more (1.56x)",
             ("e2e_fifo", "e2e_tier1_migration", "e2e_tier12_migration")),
    Ablation("A3", "+ HistoSpec", "end-to-end throughput", "x1.50 more (2.34x)",
             ("e2e_fifo", "e2e_tier12_migration", "e2e_histospec")),
    Ablation("A4", "HistoSpec per step over training", "rollout tokens/s ratio, acceptance",
             "up to 1.86x; acceptance 65-79% rising", ("demo_paired",)),
    Ablation("A5", "rollout batch size", "HistoSpec rollout speed-up", "holds 1.80-1.86x at large batch",
             ("real_session",), ("rows", ())),
    Ablation("A6", "HistoPipe on/off", "time per 10 steps, migrated share",
             "up to 1.68x; 2.2-5.5% migrated", ("e2e_fifo", "e2e_tier12_migration")),
    Ablation("A10", "sampling temperature", "acceptance, speed-up", "gains shrink as T rises",
             ("real_session",), ("rollout.temperature", ())),
    Ablation("K1", "branch choice reward vs count", "acceptance", "reward (paper text); count (specRL code)",
             ("real_session",), ("spec.branch", ("reward", "count"))),
    Ablation("K2", "draft window aimd / mimd / fixed / goodput", "tokens per forward (and tokens/s live)",
             "aimd (paper); mimd (specRL code); goodput (ours)", ("real_session",),
             ("spec.window", ("aimd", "mimd", "fixed", "goodput"))),
    Ablation("K3", "minimum match 3 vs 4", "hit rate (passes with a draft)", "paper 3, code 4",
             ("real_session",), ("spec.pattern_min", (3, 4))),
    Ablation("K4", "min_token_prob", "draft length, acceptance", "code 0.1",
             ("real_session",), ("spec.min_token_prob", (0.0, 0.1, 0.3))),
    Ablation("K6", "history depth 1 vs 2", "acceptance", "paper 1", ("real_session",),
             ("spec.history_depth", (1, 2))),
    Ablation("O5", "epoch e vs e+1", "share of tokens a drafter predicts", "75-95%",
             ("real_session", "e2e_histospec")),
    Ablation("O6", "epoch e vs e+1", "share of prompts with a large length-rank shift", "2-4%",
             ("e2e_histospec", "real_session")),
    Ablation("L1", "HistoSpec off / AIMD / goodput over a learning run (demo)",
             "per epoch: entropy, acceptance, tokens per sequence pass, rollout and end-to-end ratios vs plain, "
             "oracle bound; identical tokens and rewards", "rollout speed-up grows as rollouts rhyme (up to 1.86x)",
             ("learn_plain", "learn_aimd", "learn_goodput", "learn_goodput_paired", "learn_oracle_paired")),
    Ablation("L2", "HistoSpec off / AIMD / goodput over a learning run (SmolLM2-135M-Instruct)",
             "as L1", "as L1", ("learn_real_plain", "learn_real_aimd", "learn_real_goodput",
                                "learn_real_goodput_paired", "learn_real_oracle_paired")),
    Ablation("L3", "sync vs one-step-off vs cross-step queues on the learning run (demo)",
             "end-to-end ratio vs sync; final-window reward within 2 SE",
             "off-policy lag keeps accuracy (verl / AReaL practice)",
             ("learn_plain", "learn_one_step_off", "learn_cross_step")),
    Ablation("L4", "fifo vs HistoPipe tiers on 4 rollout workers over the learning run (demo)",
             "rollout makespan, idle share of the workers, end-to-end ratio vs fifo (epochs with history)",
             "HistoPipe 1.43-1.56x end to end (Math-14B, GPU cluster)",
             ("learn_workers_fifo", "learn_workers_histopipe", "learn_workers_paired")),
    Ablation("L5", "the paper's regime: long-tailed reasoning rollouts (ledger task, 4,096 new tokens)",
             "per epoch: length p50/p90/p99/max, reward, rollout share, HistoSpec paired rollout and end-to-end "
             "ratios, acceptance; HistoPipe vs fifo replayed on 4 workers, Gantt; held-out gain of two seeds",
             "rollout 84-91% of a step; HistoSpec 1.86x, HistoPipe 1.68x, 2.6x end to end",
             ("longtail_goodput_paired", "longtail_plain_seed0", "longtail_plain_seed1")),
    Ablation("L6", "L5's run that both learns and recurs: 48 steps over 192 prompts seen twice (ledger task)",
             "L5's per-epoch figures and HistoPipe replay over the learning run; its held-out gain on 400 problems",
             "as L5", ("longtail_recur_paired",)),
    Ablation("L7", "L6 with run seed 1: its second seed (ledger task)",
             "L6's figures over the second seed's run; the held-out gain of both seeds, pooled",
             "as L5", ("longtail_recur_seed1_paired",)),
)}

SUITES: dict[str, tuple[str, ...]] = {
    "paper": tuple(a for a in ABLATIONS if not a.startswith("L")),
    "histopipe": ("A1", "A2", "A6", "O6"),
    "histospec": ("A3", "A4", "A5", "A10", "K1", "K2", "K3", "K4", "K6", "O5"),
    "learning": ("L1", "L2", "L3", "L4"),
    "longtail": ("L5",),
    "longtail_recur": ("L6",),  # ~1.5 h on 2 cores after the warm start: --out results/longtail shares L5's
    "longtail_recur_seed1": ("L7",),  # as longtail_recur, with run seed 1 (both seeds' gain pooled where L6's unit ran)
}


@dataclass(frozen=True)
class SessionPlan:
    """What the rollout session runs (one fixed policy, no training; ``units.session``).

    Attributes:
      epochs: plain rollouts of every row per temperature at the first temperature (the history
        of epoch e is epoch e - 1; K6 needs 3); other temperatures run 2.
      temperatures: A10's sweep; the first is the main one.
      batch_prompts: A5's sweep, in prompts (rows = prompts x ``grpo.samples_per_prompt``).
      live_windows: window policies timed live at the first temperature (K2; the rest replayed).
      seed: rollout keys.
    """

    epochs: int = 3
    temperatures: tuple[float, ...] = (1.0, 0.6, 0.3)
    batch_prompts: tuple[int, ...] = (1, 2, 4, 8)
    live_windows: tuple[str, ...] = ("aimd", "mimd", "fixed", "goodput")
    seed: int = 0


# tiny model shape for the tests (configs/tiny_test.yaml's, one layer)
_TINY_MODEL = ("model.tiny.hidden_size=32", "model.tiny.intermediate_size=64", "model.tiny.num_layers=1",
               "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "model.tiny.head_dim=16",
               "model.scan_unroll=1", "data.num_train=200", "data.num_eval=2", "data.tokenizer_vocab_size=256")


@dataclass(frozen=True)
class Scale:
    """Overrides by unit kind (applied after the config file) and the session plan.

    Attributes:
      name: ``full``, ``quick`` or ``tiny``.
      overrides: unit kind -> ``--set`` strings.
      session: the ``SessionPlan``.
      config_by_kind: unit kind -> the config that replaces its units' configs (``tiny``: the
        session's test model).
      config_dir: where the paper units' configs live instead of ``configs/ablations`` (same file
        names; ``gpu``: ``configs/ablations/gpu``, the real-scale recipe). The learning runs
        (``LEARN_KINDS``) keep their configs: they are the recipes a GPU runs as they are.
      e2e_steps_skipped: first GRPO steps left out of the end-to-end figures (they compile).
      warmup: compile every rollout program of the GRPO units before step 1 (``e2e.warm_up``);
        off for the tests (they time nothing and compile only what they run).
    """

    name: str
    overrides: dict[str, tuple[str, ...]] = field(default_factory=dict)
    session: SessionPlan = SessionPlan()
    config_by_kind: dict[str, str] = field(default_factory=dict)
    config_dir: str = ""
    e2e_steps_skipped: int = 1
    warmup: bool = True


_QUICK_DEMO = ("grpo.steps=6", "grpo.prompts_per_step=8", "grpo.num_prompts=16")
_QUICK_LEARN = {"learn": ("grpo.steps=12", "grpo.num_prompts=32"),  # 2 steps per epoch, 6 epochs
                "learn_paired": ("grpo.steps=12", "grpo.num_prompts=32"),
                "learn_twin": ("grpo.steps=12", "grpo.num_prompts=32"),
                "learn_real": ("grpo.steps=8", "grpo.num_prompts=8"),  # 2 steps per epoch, 4 epochs
                "learn_real_paired": ("grpo.steps=8", "grpo.num_prompts=8")}
_TINY_DEMO = _TINY_MODEL + ("rollout.max_new_tokens=8", "rollout.max_slots=4", "sft.steps=1", "sft.batch_size=4",
                            "sft.warmup_steps=0", "grpo.steps=2", "grpo.prompts_per_step=2",
                            "grpo.samples_per_prompt=2", "grpo.num_prompts=2")

SCALES: dict[str, Scale] = {s.name: s for s in (
    Scale("full"),
    Scale("quick", {"sft": ("sft.steps=100", "data.num_eval=16"), "e2e": _QUICK_DEMO, "paired": _QUICK_DEMO,
                    "session": ("grpo.num_prompts=4", "rollout.max_new_tokens=48", "rollout.max_slots=16"),
                    **_QUICK_LEARN},
          SessionPlan(temperatures=(1.0, 0.3), batch_prompts=(1, 4), live_windows=("aimd", "goodput"))),
    Scale("tiny", {"sft": _TINY_DEMO, "e2e": _TINY_DEMO + ("parallel.rollout_workers=2",), "paired": _TINY_DEMO,
                   "session": ("grpo.num_prompts=2", "grpo.samples_per_prompt=2", "rollout.max_new_tokens=8",
                               "rollout.max_slots=4"),
                   "learn": _TINY_DEMO + ("grpo.steps=3", "rollout.temperature=0.1"),
                   "learn_paired": _TINY_DEMO + ("grpo.steps=3", "rollout.temperature=0.1"),
                   "learn_twin": _TINY_DEMO + ("grpo.steps=3", "rollout.temperature=0.1"),
                   "learn_real": _TINY_DEMO + ("model.path=''", "grpo.steps=3", "rollout.temperature=0.1"),
                   "learn_real_paired": _TINY_DEMO + ("model.path=''", "grpo.steps=3", "rollout.temperature=0.1")},
          SessionPlan(temperatures=(1.0, 0.3), batch_prompts=(1, 2), live_windows=("aimd", "goodput")),
          config_by_kind={"session": _cfg("histospec_tiny")},
          e2e_steps_skipped=0, warmup=False),
    Scale("gpu", session=SessionPlan(batch_prompts=(8, 16, 32)), config_dir=f"{ABLATION_DIR}/gpu"),
)}


def suite_ids(suite: str, only: str = "") -> list[str]:
    """The ids of ``suite`` (or of ``only``, comma-separated ids, within it), in table order.

    Raises:
      AblationError: unknown suite or id.
    """
    if suite not in SUITES:
        raise AblationError(f"unknown suite {suite!r}; known: {', '.join(SUITES)}")
    ids = list(SUITES[suite])
    if not only:
        return ids
    wanted = [x.strip().upper() for x in only.split(",") if x.strip()]
    bad = [x for x in wanted if x not in ids]
    if bad:
        raise AblationError(f"--only {','.join(bad)}: not in suite {suite!r} ({', '.join(ids)})")
    return [x for x in ids if x in wanted]


def units_of(ids: list[str]) -> list[str]:
    """The units the ids need, their prerequisites first, in ``UNITS`` order."""
    need: set[str] = set()
    todo = [u for i in ids for u in ABLATIONS[i].units]
    while todo:
        u = todo.pop()
        if u not in need:
            need.add(u)
            todo.extend(UNITS[u].needs)
    return [u for u in UNITS if u in need]


def unit_config(unit: Unit, scale: Scale) -> tuple[str, tuple[str, ...]]:
    """``(config path, overrides)`` of ``unit`` at ``scale`` (path repository-relative)."""
    path = unit.config
    if scale.config_dir and unit.kind not in LEARN_KINDS and unit.name not in LEARN_WARM_STARTS:
        path = f"{scale.config_dir}/{Path(path).name}"
    path = scale.config_by_kind.get(unit.kind, path)
    return path, scale.overrides.get(unit.kind, ())


def get_scale(name: str) -> Scale:
    """The scale called ``name``. Raises ``AblationError`` when unknown."""
    if name not in SCALES:
        raise AblationError(f"unknown scale {name!r}; known: {', '.join(SCALES)}")
    return SCALES[name]


def listing() -> str:
    """``python -m rhyme_lab ablate --list``: every id with its configs, sweep, measure and paper figure."""
    lines = []
    for a in ABLATIONS.values():
        sweep = f"; sweep {a.sweep[0]} in {list(a.sweep[1]) or 'the scale plan'}" if a.sweep else ""
        lines.append(f"{a.id:4s} {a.varied}{sweep}\n     measures: {a.measured} (paper: {a.paper})\n"
                     f"     runs: " + "; ".join(f"{u} = {UNITS[u].config}" for u in a.units))
    lines.append("\nunits (each run once per results directory, shared by the ids):")
    lines += [f"  {u.name:22s} {u.config:50s} {u.what}" for u in UNITS.values()]
    lines.append("\nsuites: " + "; ".join(f"{k} = {' '.join(v)}" for k, v in SUITES.items()))
    return "\n".join(lines)
