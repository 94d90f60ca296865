"""HistoPipe cost model: predicted seconds for one rollout worker to generate a batch.

HistoPipe's tier 2 uses a profiled cost model T(tokens, batch) per worker (RhymeRL,
arXiv 2508.18588, s.5). The form is

    T(tokens, batch) = tokens * (a + b * batch) + c * batch      [seconds]

for ``batch`` sequences whose longest is ``tokens`` tokens: ``tokens`` decode steps, each costing a
fixed ``a`` (weights read, launch) plus ``b`` per sequence in the batch (KV reads, sampling), and a
per-sequence cost ``c`` (prefill, admission). ``T(., 0) = 0``: a worker with no rows costs nothing.

With ragged lengths the batch shrinks as rows finish; summing ``a + b * live_rows`` over the decode
steps gives ``decode_cost`` = ``a * max(L) + b * sum(L) + c * rows`` (``T`` is its upper bound
when every row has the longest length). The planner plans with ``T``; the replay benchmark
simulates with ``decode_cost``.

Where a, b, c come from: the engine's one measured model is its pass-cost profile
(``rhyme_jax.rollout.pass_cost.PassCost``: seconds of every decode/verify program, profiled at
engine start-up and cached). ``CostModel.from_pass_cost`` fits this form to it: a decode pass of
``S`` rows costs ``a + b S``, and each packed token beyond one per row (a draft token, or a prompt
token of a prefill) costs ``g``, so ``c = g * prompt_tokens``. ``python -m benchmarks.schedule
--mode profile`` derives the model that way and checks it against whole ``generate`` calls;
``fit`` (a non-negative least-squares fit to measured ``(tokens, batch, seconds)`` samples) is
that check's comparison. ``save``/``load`` keep a, b, c as JSON (``sched.cost_model``); without a
file the planner uses ``DEFAULT_COST_MODEL``'s placeholder constants.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from jaxtyping import Float

from rhyme_jax.io.atomic import atomic_write

FORMAT_VERSION = 1
FORM = "T(tokens, batch) = tokens * (a + b * batch) + c * batch"


class CostModelError(ValueError):
    """Unusable profiling samples, or a missing/corrupt cost-model file (names the path and field)."""


@dataclass(frozen=True)
class CostModel:
    """``T(tokens, batch) = tokens * (a + b * batch) + c * batch`` seconds.

    Attributes:
      a: seconds per decode step (batch-independent part), >= 0.
      b: seconds per decode step per sequence in the batch, >= 0.
      c: seconds per sequence (prefill/admission), >= 0.
    """

    a: float
    b: float
    c: float

    def __post_init__(self):
        for name in ("a", "b", "c"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) \
                    or not math.isfinite(v) or v < 0:
                raise CostModelError(f"cost model field {name!r}: expected a finite number >= 0, got {v!r}")
            object.__setattr__(self, name, float(v))

    def seconds(self, tokens, batch) -> Float[np.ndarray, "..."] | float:
        """``T(tokens, batch)`` in seconds; numpy-broadcast over array arguments (0 where batch is 0).

        Args:
          tokens: longest sequence length in tokens (decode steps), float or array.
          batch: number of sequences, float or array (broadcast with ``tokens``).
        """
        t = np.asarray(tokens, dtype=np.float64)
        bt = np.asarray(batch, dtype=np.float64)
        out = np.where(bt > 0, t * (self.a + self.b * bt) + self.c * bt, 0.0)
        return float(out) if out.ndim == 0 else out

    __call__ = seconds

    def decode_cost(self, lengths) -> float:
        """Seconds to generate rows of the given lengths together in one batch, the batch shrinking
        as rows finish: ``sum over decode steps t of (a + b * live_t) + c * rows``
        = ``a * max(L) + b * sum(L) + c * rows`` (0 for no rows).

        Args:
          lengths: ``int[R]`` (or float) response lengths in tokens.
        """
        L = np.asarray(lengths, dtype=np.float64).reshape(-1)
        if L.size == 0:
            return 0.0
        return float(self.a * L.max() + self.b * L.sum() + self.c * L.size)

    @classmethod
    def fit(cls, samples) -> "CostModel":
        """Fit (a, b, c) >= 0 to measured samples by non-negative least squares
        (``scipy.optimize.nnls`` on the columns ``tokens``, ``tokens * batch``, ``batch``).

        Args:
          samples: ``float[N, 3]`` rows ``(tokens, batch, seconds)`` (or an iterable of triples);
            N >= 3, all finite and >= 0.

        Raises:
          CostModelError: wrong shape, non-finite/negative values, or samples that cannot tell
            a, b, c apart (the design matrix has rank < 3: vary both tokens and batch).
        """
        from scipy.optimize import nnls

        s = np.asarray(samples, dtype=np.float64)
        if s.ndim != 2 or s.shape[1] != 3 or s.shape[0] < 3:
            raise CostModelError(f"samples: expected N >= 3 rows of (tokens, batch, seconds), got shape {s.shape}")
        if not np.all(np.isfinite(s)) or np.any(s < 0):
            raise CostModelError("samples: every (tokens, batch, seconds) value must be finite and >= 0")
        tokens, batch, secs = s.T
        X = np.stack([tokens, tokens * batch, batch], axis=1)
        if np.linalg.matrix_rank(X) < 3:
            raise CostModelError("samples: a, b, c are not identifiable (vary both tokens and batch)")
        scale = np.maximum(np.abs(X).max(axis=0), 1e-300)  # column scaling for conditioning
        coef, _ = nnls(X / scale, secs)
        a, b, c = (coef / scale).tolist()
        return cls(a, b, c)

    @classmethod
    def from_pass_cost(cls, pass_cost, prompt_tokens: float) -> "CostModel":
        """Fit ``T(tokens, batch)`` to the engine's pass-cost profile: non-negative least squares
        of ``seconds ~ a + b * rows + g * (tokens - rows)`` over its decode/verify programs
        (``pass_cost.seconds``: ``{(rows, tokens, max_q_len): seconds}``, the profiled figures),
        then ``c = g * prompt_tokens``: a sequence's admission costs the prefill of its prompt at
        the marginal seconds of one packed token. A decode pass of ``S`` rows costs ``a + b S``.

        Args:
          pass_cost: a ``rhyme_jax.rollout.pass_cost.PassCost`` holding a profile (seconds).
          prompt_tokens: tokens a sequence prefills on admission (e.g. the mean prompt length of
            the run's prompts; with prompt-prefix sharing, what each sample prefills), >= 0.

        Raises:
          CostModelError: no profile (the analytical prior has no seconds), ``prompt_tokens``
            negative or not finite, or programs that cannot tell a, b, g apart (they need two row
            buckets and a verify program packing more tokens than rows).
        """
        from scipy.optimize import nnls

        if not math.isfinite(float(prompt_tokens)) or float(prompt_tokens) < 0:
            raise CostModelError(f"prompt_tokens: expected a finite number >= 0, got {prompt_tokens!r}")
        progs = sorted(getattr(pass_cost, "seconds", {}).items())
        if not progs:
            raise CostModelError("pass_cost: no profiled programs (the analytical prior has no seconds)")
        rows = np.array([k[0] for k, _ in progs], np.float64)
        tokens = np.array([k[1] for k, _ in progs], np.float64)
        secs = np.array([v for _, v in progs], np.float64)
        X = np.stack([np.ones_like(rows), rows, tokens - rows], axis=1)
        if np.linalg.matrix_rank(X) < 3:
            raise CostModelError("pass_cost: a, b, c are not identifiable (the profile needs decode programs of "
                                 "two row buckets and a verify program; spec-enabled plans have both)")
        scale = np.maximum(np.abs(X).max(axis=0), 1e-300)
        coef, _ = nnls(X / scale, secs)
        a, b, g = (coef / scale).tolist()
        return cls(a, b, g * float(prompt_tokens))

    def save(self, path: str | Path, meta: dict | None = None) -> Path:
        """Write ``{"version", "form", "a", "b", "c"[, "meta"]}`` as JSON atomically.

        Args:
          path: destination file (parent directories are created).
          meta: optional JSON-serialisable provenance (device, model, sample count).
        """
        doc = {"version": FORMAT_VERSION, "form": FORM, "a": self.a, "b": self.b, "c": self.c}
        if meta is not None:
            doc["meta"] = meta
        path = Path(path)
        with atomic_write(path, "w") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        """Read a file written by ``save``.

        Raises:
          CostModelError: the file is missing or not JSON, or a field (``a``, ``b``, ``c``,
            ``version``) is missing or invalid; the message names the file and the field.
        """
        path = Path(path)
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CostModelError(f"{path}: no cost-model file") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CostModelError(f"{path}: not a cost-model JSON file ({exc})") from None
        if not isinstance(doc, dict):
            raise CostModelError(f"{path}: expected a JSON object with fields a, b, c")
        if doc.get("version", FORMAT_VERSION) != FORMAT_VERSION:
            raise CostModelError(f"{path}: field 'version': expected {FORMAT_VERSION}, got {doc['version']!r}")
        vals = {}
        for name in ("a", "b", "c"):
            if name not in doc:
                raise CostModelError(f"{path}: missing field {name!r}")
            v = doc[name]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise CostModelError(f"{path}: field {name!r}: expected a finite number >= 0, got {v!r}")
            vals[name] = float(v)
        return cls(**vals)


# Placeholder values until a device is profiled (seconds): 1 ms per decode step, 20 us per
# sequence per step, 1 ms per sequence. python -m benchmarks.schedule uses these without --cost-model.
DEFAULT_COST_MODEL = CostModel(a=1e-3, b=2e-5, c=1e-3)
