"""Weights & Biases as one more sink of the per-step metrics (``run.report_to: [..., wandb]``).

``wandb`` is an optional extra (``pip install 'rhyme-jax[wandb]'``): it is imported only when a
run asks for it, and ``require_wandb`` turns its absence into one line naming the config key.
Each ``MetricsWriter`` with a ``WandbSink`` is one W&B run whose history rows are the
``metrics.jsonl`` rows: the same keys, ``step`` as the W&B step (``wandb.log(..., step=step)``);
``phase`` is not logged (no two phases share a key: ``docs/metrics.md``). ``WANDB_MODE``,
``WANDB_ENTITY`` and wandb's other environment variables apply as wandb documents them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPORT_KEY = "run.report_to"  # the config key that asks for wandb (named in errors)
DEFAULT_PROJECT = "rhyme-jax"


class WandbMissingError(ImportError):
    """``wandb`` was asked for but is not installed (the message names ``run.report_to``)."""


def require_wandb():
    """Import and return the ``wandb`` module.

    Raises:
      WandbMissingError: it is not installed (or fails to import); one line naming
        ``run.report_to`` and the extra that installs it.
    """
    try:
        import wandb
    except ImportError as exc:
        raise WandbMissingError(
            f"{REPORT_KEY} lists 'wandb' but the wandb package cannot be imported ({exc}); "
            f"pip install 'rhyme-jax[wandb]', or drop 'wandb' from {REPORT_KEY}") from None
    return wandb


@dataclass(frozen=True)
class WandbSettings:
    """Where a W&B run goes; an empty field falls back to wandb's environment variable, then to
    a default.

    Attributes:
      project: ``$WANDB_PROJECT``, else ``"rhyme-jax"``.
      name: run display name; ``$WANDB_NAME``, else ``default_name``.
      directory: where wandb writes its files (``<directory>/wandb/``); ``$WANDB_DIR``, else
        ``default_dir``.
      default_name: the run's own name (``run.name``).
      default_dir: the run directory.
      group: W&B group (the SFT warm start and GRPO of one run share ``run.name``).
      job_type: ``"grpo"`` or ``"sft"``.
      config: the run configuration (nested dict), logged as the W&B config.
    """

    project: str = ""
    name: str = ""
    directory: str = ""
    default_name: str = ""
    default_dir: str = ""
    group: str | None = None
    job_type: str | None = None
    config: dict[str, Any] = field(default_factory=dict, hash=False)

    def init_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``wandb.init`` (project, name, dir, group, job_type, config)."""
        env = os.environ
        directory = self.directory or env.get("WANDB_DIR") or self.default_dir
        return {"project": self.project or env.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                "name": self.name or env.get("WANDB_NAME") or self.default_name or None,
                "dir": str(directory) if directory else None, "group": self.group,
                "job_type": self.job_type, "config": self.config}


class WandbSink:
    """One W&B run fed with ``MetricsWriter`` rows.

    Args:
      settings: where the run goes and its config.

    Raises:
      WandbMissingError: wandb is not installed.
    """

    def __init__(self, settings: WandbSettings):
        wandb = require_wandb()
        kwargs = settings.init_kwargs()
        if kwargs["dir"]:
            Path(kwargs["dir"]).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(**kwargs)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Log one row's metrics (float values, keys as in ``metrics.jsonl``) at W&B step ``step``."""
        if self._run is not None and metrics:
            self._run.log(dict(metrics), step=int(step))

    def close(self) -> None:
        """Finish the W&B run (idempotent)."""
        if self._run is not None:
            self._run.finish()
            self._run = None
