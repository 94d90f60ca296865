"""The real-model rollout workload shared by the real-model benchmarks
(``python -m benchmarks.rollout_real``, ``python -m benchmarks.peers``).

SmolLM2-135M-Instruct on GSM8K questions in the model's chat template (the prompt template of
``configs/gsm8k_smollm2_135m.yaml``), so every engine compared sees the same prompt tokens.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (configs/ lives there)
RECIPE = ROOT / "configs" / "gsm8k_smollm2_135m.yaml"
MODEL = "smollm2-135m-instruct"
# The workload both benchmarks default to (rows = prompts x samples), and their --quick smoke size.
DEFAULTS = dict(prompts=8, samples=4, max_new_tokens=384, temperatures="1.0,0.6,0.3")
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
    """The first ``n`` GSM8K problems (``rhyme_jax.data.Problem``) of ``split`` after ``offset``
    (the recipe's data paths; empty = the GSM8K copy vendored with the package)."""
    from rhyme_jax.data import gsm8k_path, load_gsm8k

    cfg = recipe()
    path = gsm8k_path(split, cfg.data.train_path if split == "train" else cfg.data.test_path)
    return load_gsm8k(path)[offset: offset + n]


def questions(n: int, split: str = "train", offset: int = 0) -> list[str]:
    """The questions of ``problems(n, split, offset)``."""
    return [p.question for p in problems(n, split, offset)]


def prompt_texts(qs: list[str]) -> list[str]:
    """Questions formatted with the recipe's chat template (no special tokens added on encode)."""
    template = recipe().model.prompt_template
    return [template.format(question=q) for q in qs]
