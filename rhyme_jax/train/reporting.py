"""The run's metrics writer as ``run.report_to`` asks: ``metrics.jsonl`` always, TensorBoard and
Weights & Biases (``io/wandb_sink.py``) when listed.
"""

from __future__ import annotations

from pathlib import Path

from rhyme_jax.config import RunConfig
from rhyme_jax.config.loader import to_dict
from rhyme_jax.io.metrics import MetricsWriter
from rhyme_jax.io.wandb_sink import WandbSettings


def wandb_settings(cfg: RunConfig, run_dir: str | Path, *, job_type: str = "grpo") -> WandbSettings | None:
    """Where the W&B run of ``run_dir`` goes (``run.wandb_*``, wandb's environment variables,
    then the defaults), with the whole run config as its W&B config; ``None`` when
    ``run.report_to`` does not list ``wandb``.

    Args:
      cfg: the run config.
      run_dir: the directory whose ``metrics.jsonl`` the W&B run mirrors (the default wandb
        directory: its files go to ``<run_dir>/wandb``).
      job_type: ``"grpo"`` (default name ``run.name``) or ``"sft"`` (default name
        ``<run.name>-sft``); both runs are in W&B group ``run.name``.
    """
    run = cfg.run
    if "wandb" not in run.report_to:
        return None
    default_name = run.name if job_type == "grpo" else f"{run.name}-{job_type}"
    name = run.wandb_name if not run.wandb_name or job_type == "grpo" else f"{run.wandb_name}-{job_type}"
    return WandbSettings(project=run.wandb_project, name=name, directory=run.wandb_dir,
                         default_name=default_name, default_dir=str(run_dir), group=run.name,
                         job_type=job_type, config=to_dict(cfg))


def metrics_writer(cfg: RunConfig, run_dir: str | Path, *, truncate_from: int | None = None,
                   job_type: str = "grpo") -> MetricsWriter:
    """``MetricsWriter(run_dir)`` with the sinks of ``run.report_to`` (see ``wandb_settings``).

    Raises:
      WandbMissingError: ``run.report_to`` lists ``wandb`` and it is not installed (``prepare``
        in ``train/preflight.py`` reports this before any work).
    """
    return MetricsWriter(run_dir, tensorboard="tensorboard" in cfg.run.report_to, truncate_from=truncate_from,
                         wandb=wandb_settings(cfg, run_dir, job_type=job_type))
