"""The real-model rollout workload shared by the real-model benchmarks
(``python -m benchmarks.rollout_real``, ``python -m benchmarks.peers``).

SmolLM2-135M-Instruct on the learning recipe's problems (``configs/arith_smollm2_135m.yaml``: the
embedded one-step arithmetic word problems, in the model's chat template), so every engine
compared sees the same prompt tokens and the workload is the one the recipe trains on. Figures in
docs/results.md dated before 2026-12-03 13:00 used GSM8K questions with 384 new tokens.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (configs/ lives there)
RECIPE = ROOT / "configs" / "arith_smollm2_135m.yaml"
MODEL = "smollm2-135m-instruct"
# The workload both benchmarks default to (rows = prompts x samples), and their --quick smoke size.
DEFAULTS = dict(prompts=8, samples=4, max_new_tokens=128, temperatures="1.0,0.6,0.3")  # the recipe's 128
QUICK = dict(prompts=2, samples=2, temperatures="1.0")


def fill_defaults(args, defaults: dict):
    """Set each ``None`` attribute of parsed ``args`` named in ``defaults``; parse
    ``args.temperatures`` ("1.0,0.6") into a list of floats. Returns ``args``."""
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.temperatures = [float(t) for t in str(args.temperatures).split(",") if t.strip()]
    return args


def recipe():
    """The SmolLM2 recipe config (``model.path`` names the model; ``model_dir`` resolves it)."""
    from rhyme_jax.config import load_config

    return load_config(RECIPE)


def model_dir(path: str = "") -> Path:
    """Checkpoint directory: ``path``, else the recipe's model (imported offline on first use)."""
    from rhyme_jax.model import hub

    return hub.ensure(path or recipe().model.path)


def problems(n: int, split: str = "train", offset: int = 0):
    """The first ``n`` problems (``rhyme_jax.data.Problem``) of the recipe's ``split`` (``train``
    or ``test``: its held-out set) after ``offset``.

    Raises:
      ValueError: ``split`` is neither ``train`` nor ``test``.
    """
    from rhyme_jax.data import load_problems

    if split not in ("train", "test"):
        raise ValueError(f"split: {split!r} is not 'train' or 'test'")
    train, held_out = load_problems(recipe().data)
    return list(train if split == "train" else held_out)[offset: offset + n]


def questions(n: int, split: str = "train", offset: int = 0) -> list[str]:
    """The questions of ``problems(n, split, offset)``."""
    return [p.question for p in problems(n, split, offset)]


def prompt_texts(qs: list[str]) -> list[str]:
    """Questions formatted with the recipe's chat template (no special tokens added on encode)."""
    template = recipe().model.prompt_template
    return [template.format(question=q) for q in qs]
