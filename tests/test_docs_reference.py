"""docs/config.md and docs/metrics.md against the code.

* docs/config.md is exactly what ``rhyme_lab.config_reference`` generates from the config
  dataclasses, and every config field has a meaning (its ``# comment`` in sections.py).
* docs/metrics.md documents every key a tiny GRPO run writes to ``metrics.jsonl`` (HistoSpec on,
  sampled evaluation, so the ``spec/`` and ``eval/`` keys are there), under the phase it is
  written in, and every key of the SFT step.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path
from typing import Literal

import pytest

from rhyme_lab import config_reference as reference

REPO = Path(__file__).resolve().parents[1]
CONFIG_DOC = REPO / "docs" / "config.md"
METRICS_DOC = REPO / "docs" / "metrics.md"
TINY = REPO / "configs" / "tiny_test.yaml"
# Two GRPO steps over 2 prompts: step 2 starts the second epoch, so HistoSpec drafts; k = 2
# sampled evaluations give the mean@k / pass@k keys.
RUN = ("grpo.steps=2", "grpo.num_prompts=2", "spec.enabled=true", "spec.window=fixed", "spec.fixed_window=4",
       "spec.min_token_prob=0.0", "spec.pattern_min=1", "spec.pattern_max=2", "run.eval_samples=2",
       "data.num_eval=4", "run.checkpoint_every=10")


# ----------------------------------------------------------------------------- docs/config.md
def test_config_reference_is_current():
    want = reference.render()
    have = CONFIG_DOC.read_text(encoding="utf-8") if CONFIG_DOC.is_file() else ""
    diff = "".join(list(difflib.unified_diff(have.splitlines(True), want.splitlines(True),
                                             "docs/config.md", "generated"))[:40])
    assert have == want, f"docs/config.md is stale; regenerate it: {reference.REGENERATE}\n{diff}"


def test_every_config_field_has_a_meaning():
    missing = reference.missing_meanings()
    assert not missing, (f"config fields without a meaning: {missing}; give each a trailing '# comment' "
                         f"in its section (rhyme_jax/config/sections.py), then run {reference.REGENERATE}")


def test_reference_rows_carry_types_defaults_and_ranges():
    rows = {row.key: row for sec in reference.sections() for row in sec.rows}
    assert rows["grpo.learning_rate"][1:4] == ("float", "0.001", "> 0.0")
    assert rows["rollout.top_p"].range == "(0, 1]"  # from fail(self, "top_p", "must be in (0, 1] ...")
    assert rows["data.max_steps"].range == ">= data.min_steps"
    assert rows["sft.warmup_steps"].range == "[0, sft.steps]"  # _check_warmup(self), a module function
    assert rows["spec.pattern_max"].range == "[spec.pattern_min, 256]"
    assert rows["parallel.fsdp"].range == ">= 1 or -1"  # fail(self, name, ...) in a loop over a tuple
    assert rows["sched.mode"].range == "`fifo`, `histopipe`" and rows["sched.mode"].type == "str"
    assert rows["model.prompt_template"].default == '"{question}\\n"'
    assert rows["model.tiny.num_kv_heads"].range == ">= 1; divides model.tiny.num_heads"
    assert [s.key for s in reference.sections()][:2] == ["model", "model.tiny"]


@dataclasses.dataclass(frozen=True)
class _Commented:
    """Comment placements ``reference.field_comments`` reads."""

    KEY = "demo"

    a: int = 1  # trailing
    #   continues a (the next field has its own trailing comment)
    b: int = 2  # b's own
    # leads c, which has no trailing comment
    c: Literal["x", "y"] = "x"
    d: str = "#"  # a '#' in a string is not a comment
    e: int = 0

    def __post_init__(self):
        if not 0 <= self.e < 5:
            raise ValueError


def test_field_comments_attach_to_the_right_field():
    assert reference.field_comments(_Commented) == {
        "a": "trailing continues a (the next field has its own trailing comment)", "b": "b's own",
        "c": "leads c, which has no trailing comment", "d": "a '#' in a string is not a comment", "e": ""}


def test_markdown_cells_escape_pipes_and_html_like_text():
    assert reference._md("a | b <run>/x `c|d` *.py") == "a \\| b \\<run>/x `c\\|d` \\*.py"


# ----------------------------------------------------------------------------- docs/metrics.md
def documented_metrics() -> set[tuple[str, str]]:
    """``(key, phase)`` pairs of the rows of docs/metrics.md's tables (``| `key` | phases | ...``)."""
    out = set()
    for line in METRICS_DOC.read_text(encoding="utf-8").splitlines():
        m = re.match(r"\|\s*`([^`]+)`\s*\|([^|]*)\|", line)
        if m:
            out.update((m.group(1), phase.strip()) for phase in m.group(2).split(","))
    return out


def undocumented(rows: list[dict]) -> list[str]:
    doc = documented_metrics()
    return sorted({f"{key} (phase {row['phase']})" for row in rows for key in row
                   if (key, row["phase"]) not in doc})


@pytest.fixture(scope="module")
def tiny_run_rows(tmp_path_factory, compile_cache):
    """Metrics rows of a 2-step tiny GRPO run with HistoSpec and sampled evaluation."""
    from rhyme_jax.config import load_config
    from rhyme_jax.io.metrics import read_metrics
    from rhyme_jax.train.trainer import GRPOTrainer

    cfg = load_config(TINY, [f"run.runs_dir={tmp_path_factory.mktemp('metrics_doc')}", *RUN])
    trainer = GRPOTrainer(cfg, reward_fn=lambda text, problem: float(len(text) % 2))
    try:
        trainer.fit()
    finally:
        trainer.close()
    return read_metrics(trainer.run_dir)


def test_metrics_doc_parses():
    doc = documented_metrics()
    assert ("reward/mean", "train") in doc and ("eval/pass_at_k", "eval") in doc and ("loss", "sft") in doc
    assert {phase for _, phase in doc} == {"train", "eval", "sft"}


def test_every_metric_of_a_grpo_run_is_documented(tiny_run_rows):
    phases = {row["phase"] for row in tiny_run_rows}
    keys = {key for row in tiny_run_rows for key in row}
    assert phases == {"train", "eval"}
    assert {"spec/drafted_tokens", "eval/pass_at_k", "eval/sampled_accuracy", "loss"} <= keys
    assert max(row.get("spec/drafted_tokens", 0) for row in tiny_run_rows) > 0  # HistoSpec drafted
    missing = undocumented(tiny_run_rows)
    assert not missing, f"metrics.jsonl keys missing from docs/metrics.md (add a table row): {missing}"


def test_every_metric_of_an_sft_step_is_documented():
    """The SFT step's metrics (``sft/metrics.jsonl`` rows are ``run_sft``'s ``log_fn`` dicts),
    traced with ``jax.eval_shape``: nothing is compiled."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from rhyme_jax.model.config import ModelConfig
    from rhyme_jax.model.transformer import Decoder
    from rhyme_jax.train.optim import make_optimizer
    from rhyme_jax.train.sft import init_opt_state, make_sft_step

    model = Decoder(ModelConfig(family="qwen3", vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=1,
                                num_heads=2, num_kv_heads=1, head_dim=8), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tx = make_optimizer(1e-3, 2, 0, 0.0, 1.0)
    batch = {"tokens": jnp.zeros((2, 8), jnp.int32), "positions": jnp.tile(jnp.arange(8), (2, 1)),
             "attn_mask": jnp.ones((2, 8), bool), "loss_mask": jnp.ones((2, 8), jnp.float32)}
    _, _, metrics = jax.eval_shape(make_sft_step(graphdef, tx), state, init_opt_state(tx, state), batch)
    missing = undocumented([{"step": 1, "phase": "sft", **metrics}])
    assert not missing, f"SFT metrics missing from docs/metrics.md (add a table row): {missing}"


def test_documented_metrics_exist_in_the_code():
    """Every documented key (or its last part, for keys built as f"{prefix}/name") is still
    written somewhere in rhyme_jax/: a renamed metric leaves no stale row."""
    source = "\n".join(p.read_text(encoding="utf-8") for p in (REPO / "rhyme_jax").rglob("*.py"))
    stale = []
    for key, _ in documented_metrics():
        last = key.rsplit("/", 1)[-1]
        if not any(s in source for s in (f'"{key}"', f'/{last}"', f'"{last}"', f"{last}=")):
            stale.append(key)
    assert not stale, f"docs/metrics.md documents keys no code writes: {sorted(set(stale))}"
