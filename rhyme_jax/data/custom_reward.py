"""The reward a run uses: the built-in verifier, or your own function named in the config
(``reward.fn: "package.module:function"``; docs/custom_reward.md).

The contract of ``reward.fn``:

* per sample (``reward.batched: false``): ``fn(response: str, problem: Problem, **reward.kwargs)
  -> float``, called once per sampled response;
* batched (``reward.batched: true``): ``fn(responses: list[str], problems: list[Problem],
  **reward.kwargs) -> Sequence[float]`` of the same length, called once per GRPO step with the
  step's responses (the samples of a prompt consecutive) and once per held-out evaluation pass.

``response`` is the decoded completion only (no prompt). ``problem`` is the ``Problem`` the prompt
came from: ``question`` (the prompt field), ``answer`` (the normalised gold answer),
``solution``, ``id`` and ``metadata`` (``data.metadata_fields``). A reward is any finite real
number; ``[0, 1]`` keeps ``eval/accuracy`` an accuracy (the held-out evaluation averages the same
rewards). A non-number or a non-finite value stops the run with a ``RewardError``; an exception
raised by the function propagates unchanged (catch it and return 0.0 to ignore bad responses, as
the built-in reward does).

The module is imported as ``python -m`` would: the working directory first, then ``PYTHONPATH``,
then the installed packages. ``GRPOTrainer(reward_fn=...)`` / ``main(argv, reward_fn=...)`` (the
Python hook) and ``reward.fn`` are exclusive: setting both is an error.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import numbers
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from rhyme_jax.config import ConfigError, RewardSection
from rhyme_jax.config.sections import term_name
from rhyme_jax.data.problems import DataError, Problem
from rhyme_jax.data.rewards import reward_fn as builtin_reward

if TYPE_CHECKING:
    from rhyme_jax.config import RunConfig

RewardFn = Callable[[str, Problem], float]


class RewardError(DataError, ConfigError):
    """``reward.fn`` cannot be used (import, attribute, signature) or returned a bad value; the
    message starts with ``reward.fn='<spec>'``."""


@dataclass(frozen=True)
class UserReward:
    """A resolved ``reward.fn``: callable per sample like the built-in reward, ``batch`` for many.

    Attributes:
      spec: ``"package.module:function"`` as configured.
      fn: the imported function; ``kwargs``: ``reward.kwargs``; ``batched``: ``reward.batched``.
    """

    spec: str
    fn: Callable[..., Any]
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False)
    batched: bool = False
    none_is_nan: bool = False  # a reward.fns entry: None = not applicable to this sample (TRL's)

    def __call__(self, response: str, problem: Problem) -> float:
        """The reward of one response (a batched ``fn`` is called with lists of one)."""
        return self.batch([response], [problem])[0]

    def batch(self, responses: Sequence[str], problems: Sequence[Problem]) -> list[float]:
        """Rewards of ``responses[i]`` to ``problems[i]``.

        Raises:
          RewardError: a value is not a finite real number, or a batched ``fn`` returned a
            sequence of another length.
        """
        if self.batched:
            out = self.fn(list(responses), list(problems), **self.kwargs)
            try:
                values = list(out)
            except TypeError:
                raise RewardError(f"reward.fn={self.spec!r} (batched) returned {type(out).__name__}, "
                                  f"not a sequence of floats") from None
            if len(values) != len(responses):
                raise RewardError(f"reward.fn={self.spec!r} (batched) returned {len(values)} rewards for "
                                  f"{len(responses)} responses")
        else:
            values = [self.fn(r, p, **self.kwargs) for r, p in zip(responses, problems)]
        return [self._checked(v, p) for v, p in zip(values, problems)]

    def _checked(self, value: Any, problem: Problem) -> float:
        if isinstance(value, numbers.Real) and math.isfinite(float(value)):
            return float(value)
        if value is None and self.none_is_nan:
            return math.nan
        raise RewardError(f"reward.fn={self.spec!r} returned {value!r:.60} for problem id {problem.id}: "
                          f"a reward must be a finite number")


@dataclass(frozen=True)
class WeightedReward:
    """``reward.fns``: the reward is ``sum_k weights[k] x parts[k]``, NaN-aware as TRL's
    ``GRPOTrainer`` (``reward_funcs`` + ``reward_weights``, ``nansum``): a function may return
    None for a sample it does not apply to, and the sum skips it.

    Attributes:
      names: each function's metrics name (``config.sections.term_name``; unique);
      parts: the resolved functions (``UserReward`` with ``none_is_nan``); weights: floats.
    """

    names: tuple[str, ...]
    parts: tuple[UserReward, ...]
    weights: tuple[float, ...]

    def __call__(self, response: str, problem: Problem) -> float:
        """The combined reward of one response."""
        return self.batch([response], [problem])[0]

    def per_function(self, responses: Sequence[str], problems: Sequence[Problem]) -> np.ndarray:
        """f64[N, K]: function k's reward of response i (NaN where it returned None).

        Raises:
          RewardError: a function returned a bad value, or every function returned None for a
            sample (TRL gives such a sample advantage 0; here it is an error).
        """
        values = np.array([part.batch(responses, problems) for part in self.parts], np.float64).T
        values = values.reshape(len(responses), len(self.parts))
        for i in np.flatnonzero(np.isnan(values).all(axis=1)):
            raise RewardError(f"reward.fns: every function returned None for problem id {problems[i].id}: "
                              f"a sample needs at least one reward")
        return values

    def combine(self, values: np.ndarray) -> list[float]:
        """The weighted sum of ``per_function``'s rows, None (NaN) entries skipped."""
        return [float(v) for v in np.nansum(values * np.asarray(self.weights, np.float64), axis=1)]

    def batch(self, responses: Sequence[str], problems: Sequence[Problem]) -> list[float]:
        """Combined rewards of ``responses[i]`` to ``problems[i]`` (raises as ``per_function``)."""
        return self.combine(self.per_function(responses, problems))


def score_batch(fn: RewardFn, responses: Sequence[str], problems: Sequence[Problem]) -> list[float]:
    """Rewards of ``responses[i]`` to ``problems[i]``: one ``fn.batch`` call for a ``UserReward`` or
    ``WeightedReward``, else ``fn(response, problem)`` per pair (the built-in rewards, a Python hook)."""
    if isinstance(fn, (UserReward, WeightedReward)):
        return fn.batch(responses, problems)
    return [float(fn(r, p)) for r, p in zip(responses, problems)]


def score_terms(fn: RewardFn, responses: Sequence[str], problems: Sequence[Problem]
                ) -> tuple[list[float], dict[str, float]]:
    """``score_batch``'s rewards, and for ``reward.fns`` each function's mean over the samples it
    scored as ``reward/<name>/mean`` (TRL ``rewards/<name>/mean``; NaN when it scored none); no
    entries for a single reward."""
    if not isinstance(fn, WeightedReward):
        return score_batch(fn, responses, problems), {}
    values = fn.per_function(responses, problems)
    scored = ~np.isnan(values)
    means = {f"reward/{name}/mean": float(values[scored[:, k], k].mean()) if scored[:, k].any() else math.nan
             for k, name in enumerate(fn.names)}
    return fn.combine(values), means


def _import(module: str, spec: str) -> Any:
    """``importlib.import_module(module)`` with the working directory first on ``sys.path`` (as
    ``python -m`` has it; the ``rhyme-jax`` console script does not).

    Raises:
      RewardError: the module is not found, or importing it raised.
    """
    cwd = os.getcwd()
    if not any(os.path.abspath(p or ".") == cwd for p in sys.path):
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            raise RewardError(f"reward.fn={spec!r}: module {module!r} not found (searched the working "
                              f"directory {cwd}, PYTHONPATH and the installed packages)") from None
        raise RewardError(f"reward.fn={spec!r}: importing {module!r} failed: ModuleNotFoundError: "
                          f"{exc}") from None
    except Exception as exc:  # noqa: BLE001 - any error in the user's module, reported in one line
        raise RewardError(f"reward.fn={spec!r}: importing {module!r} failed: {type(exc).__name__}: "
                          f"{' '.join(str(exc).split())}") from None


def _check_signature(fn: Callable[..., Any], section: RewardSection) -> None:
    """``fn`` accepts the documented call (module docstring) with ``section.kwargs``.

    Raises:
      RewardError: it does not (the message shows its signature and the expected call).
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: checked by the first call
        return
    call = "fn(responses, problems, **reward.kwargs)" if section.batched else "fn(response, problem, **reward.kwargs)"
    try:
        sig.bind(None, None, **section.kwargs)
    except TypeError as exc:
        raise RewardError(f"reward.fn={section.fn!r}: wrong signature {sig} for the call {call} "
                          f"with reward.kwargs={dict(section.kwargs)} ({exc})") from None


def load_reward(section: RewardSection, extraction: str = "marker") -> RewardFn:
    """The reward of a ``reward`` config section: ``reward.fns`` (a ``WeightedReward``) or
    ``reward.fn`` imported and checked, else the built-in reward of ``data.answer_extraction``
    (``extraction``). Each ``reward.fns`` entry is checked as ``reward.fn`` is.

    Raises:
      RewardError: the module is not found or fails to import, the attribute is missing, not
        callable, or cannot take the documented arguments; one line starting with ``reward.fn=``.
      ValueError: an unknown ``extraction`` (built-in reward).
    """
    if section.fns:
        parts = tuple(dataclasses.replace(_load_one(RewardSection(t.fn, dict(t.kwargs), t.batched)), none_is_nan=True)
                      for t in section.fns)
        return WeightedReward(tuple(term_name(t.fn) for t in section.fns), parts,
                              tuple(float(t.weight) for t in section.fns))
    if not section.fn:
        return builtin_reward(extraction)
    return _load_one(section)


def _load_one(section: RewardSection) -> UserReward:
    """``section.fn`` imported and its signature checked (raises as ``load_reward``)."""
    spec = section.fn
    module_name, _, attr = spec.partition(":")
    obj = _import(module_name, spec)
    for part in attr.split("."):
        if not hasattr(obj, part):
            where = getattr(sys.modules.get(module_name), "__file__", None) or module_name
            raise RewardError(f"reward.fn={spec!r}: module {module_name!r} ({where}) has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardError(f"reward.fn={spec!r}: {attr!r} is not callable (its type is {type(obj).__name__})")
    _check_signature(obj, section)
    return UserReward(spec, obj, dict(section.kwargs), section.batched)


def task_reward(cfg: RunConfig) -> RewardFn:
    """The reward of a run config: ``load_reward(cfg.reward, cfg.data.answer_extraction)``."""
    return load_reward(cfg.reward, cfg.data.answer_extraction)


def choose_reward(cfg: RunConfig, hook: RewardFn | None) -> RewardFn:
    """The GRPO reward of a run: the Python ``hook`` when given, else ``task_reward(cfg)``.

    Raises:
      RewardError: both the hook and ``reward.fn`` are set, or ``reward.fn`` cannot be used.
    """
    if hook is not None and (cfg.reward.fn or cfg.reward.fns):
        key = f"reward.fn={cfg.reward.fn!r}" if cfg.reward.fn else "reward.fns"
        raise RewardError(f"{key} and the Python reward_fn= hook are both set: "
                          f"use one (remove it from the config, or stop passing reward_fn=)")
    return hook if hook is not None else task_reward(cfg)
