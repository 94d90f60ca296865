"""Per-step run metrics: ``<run_dir>/metrics.jsonl`` plus TensorBoard events in ``<run_dir>/tb``
and, when asked, a Weights & Biases run (``io/wandb_sink.py``).

Each jsonl line is one JSON object ``{"step": int, "phase": str, <name>: float, ...}``. The file
is append-only during a run; on resume ``MetricsWriter(truncate_from=step)`` atomically rewrites
it without rows of ``step >= truncate_from`` (and without a half-written last line from a killed
run) and purges TensorBoard events from that step on, so a resumed run has no duplicate steps.
"""

from __future__ import annotations

import json
import math
import numbers
import time
from pathlib import Path
from typing import Any

from rhyme_jax.io.atomic import atomic_write
from rhyme_jax.io.jsonl import JsonlError, parse_jsonl
from rhyme_jax.io.wandb_sink import WandbSettings, WandbSink

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"


class MetricsError(ValueError):
    """Bad metrics input or a corrupt metrics file (the message names file:line or the key)."""


def _parse_lines(path: Path) -> tuple[list[dict], bool]:
    """Rows of a metrics file and whether it needs repair (a truncated or corrupt last line)."""
    rows: list[dict] = []
    lines = path.read_text(encoding="utf-8").split("\n")
    # The text after the final "\n" is "" for a complete file, or a partial line from a killed run.
    dirty = lines[-1] != ""
    try:
        for record in parse_jsonl(lines, path):
            if not isinstance(record.value, dict) or "step" not in record.value:
                if _is_last(lines, record.lineno):
                    return rows, True
                raise MetricsError(f"{record.where}: corrupt metrics line (not a metrics object with a 'step')")
            rows.append(record.value)
    except JsonlError as exc:
        if _is_last(lines, exc.lineno):  # truncated last line: the run died mid-write
            return rows, True
        raise MetricsError(f"{exc.where}: corrupt metrics line ({exc.detail})") from None
    return rows, dirty


def _is_last(lines: list[str], lineno: int) -> bool:
    """Whether 1-based line ``lineno`` is the last non-blank one of ``lines``."""
    return not any(ln.strip() for ln in lines[lineno:])


def read_metrics(run_dir: str | Path) -> list[dict]:
    """All metric rows of a run in file order (``[]`` if there is no metrics file yet).

    A truncated or unparsable *last* line (run killed mid-write) is skipped.

    Raises:
      MetricsError: a line other than the last is not a JSON object with a ``"step"`` key
        (message names file:line).
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return _parse_lines(path)[0]


def _atomic_write_rows(path: Path, rows: list[dict]) -> None:
    with atomic_write(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def _to_float(key: str, value: Any) -> float:
    if isinstance(value, (bool, numbers.Number)) or hasattr(value, "__float__"):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise MetricsError(f"metric {key!r}: expected a number, got {type(value).__name__}")


class MetricsWriter:
    """Writes per-step metrics to ``<run_dir>/metrics.jsonl``, TensorBoard (tensorboardX) and W&B.

    Args:
      run_dir: run output directory (created if missing).
      tensorboard: also write TensorBoard event files under ``<run_dir>/tb``.
      truncate_from: on resume, the first step the resumed run will log; rows with
        ``step >= truncate_from`` are dropped (atomic rewrite) and TensorBoard events from that
        step on are purged. ``None`` keeps all rows (a truncated last line is still repaired).
        A W&B run is never rewound: a resumed run is a new W&B run.
      wandb: also log every row to a new W&B run made with these settings; ``None`` = no W&B
        (wandb is not imported).

    Raises:
      WandbMissingError: ``wandb`` is given and the package is not installed.

    Use as a context manager or call ``close()``.
    """

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, truncate_from: int | None = None,
                 wandb: WandbSettings | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if self.path.is_file():
            rows, dirty = _parse_lines(self.path)
            if truncate_from is not None:
                kept = [r for r in rows if int(r["step"]) < truncate_from]
                dirty = dirty or len(kept) != len(rows)
                rows = kept
            if dirty:
                _atomic_write_rows(self.path, rows)
        self._wandb = WandbSink(wandb) if wandb is not None else None  # before the open handles: a failure leaks none
        self._fh = self.path.open("a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            # A unique, time-ordered suffix: a writer reopened within the same second would
            # otherwise reuse (and truncate) the previous event file's name.
            self._tb = SummaryWriter(logdir=str(self.run_dir / TB_DIR), purge_step=truncate_from,
                                     filename_suffix=f".{time.time_ns():020d}")

    def log(self, step: int, metrics: dict[str, float], phase: str = "train") -> None:
        """Append one row ``{"step", "phase", **metrics}`` and the matching TensorBoard scalars
        (and W&B history row: the same keys but ``phase``, at W&B step ``step``).

        Values may be Python, NumPy or JAX scalars (converted with ``float``); non-finite values
        are written as JSON ``NaN``/``Infinity``. TensorBoard tags are the key itself when it
        contains ``"/"`` (e.g. ``"eval/accuracy"``), else ``"<phase>/<key>"``.

        Raises:
          MetricsError: a key is ``"step"``/``"phase"`` or a value is not a number.
        """
        row: dict[str, Any] = {"step": int(step), "phase": str(phase)}
        for key, value in metrics.items():
            if key in ("step", "phase"):
                raise MetricsError(f"metric name {key!r} is reserved")
            row[str(key)] = _to_float(key, value)
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for key, value in row.items():
                if key in ("step", "phase") or not math.isfinite(value):
                    continue
                tag = key if "/" in key else f"{phase}/{key}"
                self._tb.add_scalar(tag, value, global_step=int(step))
        if self._wandb is not None:
            self._wandb.log(step, {k: v for k, v in row.items() if k not in ("step", "phase")})

    def close(self) -> None:
        """Flush and close the jsonl file, the TensorBoard writer and the W&B run (idempotent)."""
        if not self._fh.closed:
            self._fh.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NullMetricsWriter:
    """``MetricsWriter`` stand-in for the non-primary processes of a multi-host run (writes
    nothing; process 0 owns the run directory's metrics)."""

    def log(self, step: int, metrics: dict[str, float], phase: str = "train") -> None:
        """Discard one row."""

    def close(self) -> None:
        """Nothing to close."""
