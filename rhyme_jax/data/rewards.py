"""Verifiable outcome reward for math answers (GSM8K ``#### <answer>`` and MATH ``\\boxed{}``).

Answer extraction follows the GSM8K convention (Cobbe et al. 2021: the final answer follows
``####``) with a fallback to the last ``\\boxed{...}`` (Hendrycks et al. 2021, MATH). Numeric
answers are compared exactly as rationals; anything else is compared symbolically with
HuggingFace Math-Verify (https://github.com/huggingface/Math-Verify).
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

from rhyme_jax.data.problems import Problem

# "1,234.5" (thousands groups) or "1234.5", optionally a fraction "3/4"; optional sign.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?")
_BOXED = "\\boxed"


def _last_boxed(text: str) -> str | None:
    """Content of the last balanced ``\\boxed{...}`` (or ``\\boxed x``) in ``text``, else None."""
    start = text.rfind(_BOXED)
    while start != -1:
        i = start + len(_BOXED)
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j].strip()
        elif i > start + len(_BOXED):  # "\boxed 5" form
            m = re.match(r"[^\s$]+", text[i:])
            if m:
                return m.group(0)
        start = text.rfind(_BOXED, 0, start)
    return None


def extract_answer(text: str) -> str | None:
    """Final answer of a response.

    Returns, in order of preference: the first number after the last ``"####"`` (thousands
    commas stripped: ``"#### 1,234 apples"`` -> ``"1234"``), or the first non-empty line after
    it when that line is LaTeX (``"#### \\frac{1}{2}"``) or no number follows; else the content of
    the last ``\\boxed{...}`` (nested braces kept); else None. Never raises (non-string -> None).
    """
    if not isinstance(text, str):
        return None
    if "####" in text:
        tail = text.rsplit("####", 1)[1]
        first = tail.strip().split("\n", 1)[0].strip()
        m = _NUMBER.search(tail)
        if first and "\\" in first and (m is None or "\\" in tail[: m.start()]):
            return first.strip("$ .")  # a LaTeX answer such as "\frac{1}{2}"
        if m:
            return re.sub(r"[,\s]", "", m.group(0))
        if first:
            return first
    return _last_boxed(text)


_LAST_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
EXTRACTIONS = ("marker", "last_number")


def extract_answer_lenient(text: str) -> str | None:
    """``extract_answer``, else the last number in the text (thousands commas stripped).

    For small instruct models that answer in prose ("... so she makes $18 every day.") rather
    than with a ``####`` marker or ``\\boxed{}``; the fallback of lm-evaluation-harness's
    GSM8K "flexible-extract" filter. Never raises.
    """
    found = extract_answer(text)
    if found is not None or not isinstance(text, str):
        return found
    numbers = _LAST_NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def _as_number(s: str) -> Fraction | None:
    """Exact rational value of a plain numeric string ("1,000", "0.5", "-3", "1/2", "$7"), else None."""
    t = s.strip().strip("$").strip()
    t = t.rstrip(".").replace(",", "").replace(" ", "")
    if t.startswith("+"):
        t = t[1:]
    if not t or not re.fullmatch(r"-?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+", t):
        return None
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(pred: str, gold: str) -> bool:
    """Whether a predicted final answer equals the gold answer.

    Both numeric (int, decimal, ``a/b``, ``"1,000"``): exact rational equality. Otherwise
    ``math_verify.verify(parse(gold), parse(pred))`` (LaTeX such as ``\\frac{1}{2}`` vs ``0.5``).
    Never raises: unparsable or empty input returns False.
    """
    if not isinstance(pred, str) or not isinstance(gold, str) or not pred.strip() or not gold.strip():
        return False
    a, b = _as_number(pred), _as_number(gold)
    if a is not None and b is not None:
        return a == b
    if b is not None and not re.search(r"\d", pred):
        return False  # a numeric gold answer cannot equal digit-free text; skip sympy
    try:
        from math_verify import parse, verify

        # Math-Verify's timeouts use signal.alarm, which only works in the main thread.
        t = 5 if threading.current_thread() is threading.main_thread() else None

        def _parse(s: str):
            s = s.strip()
            return parse(s if "$" in s or "\\boxed" in s else f"${s}$", parsing_timeout=t)

        g, p = _parse(gold), _parse(pred)
        if not g or not p:
            return False
        return bool(verify(g, p, timeout_seconds=t))
    except Exception:  # noqa: BLE001 - a reward must never crash the trainer on garbage text
        return False


def reward(response_text: str, problem: Problem) -> float:
    """Outcome reward: 1.0 if the response's final answer matches ``problem.answer`` else 0.0.

    The response is judged by ``extract_answer`` + ``answers_match``; garbage, empty or
    answer-less responses get 0.0. Never raises.
    """
    try:
        pred = extract_answer(response_text)
        return 1.0 if pred is not None and answers_match(pred, problem.answer) else 0.0
    except Exception:  # noqa: BLE001
        return 0.0


def lenient_reward(response_text: str, problem: Problem) -> float:
    """``reward`` with ``extract_answer_lenient`` (the last number when no marker). Never raises."""
    try:
        pred = extract_answer_lenient(response_text)
        return 1.0 if pred is not None and answers_match(pred, problem.answer) else 0.0
    except Exception:  # noqa: BLE001
        return 0.0


def reward_fn(extraction: str):
    """The reward of a ``data.answer_extraction`` mode: ``"marker"`` -> ``reward``,
    ``"last_number"`` -> ``lenient_reward``.

    Raises:
      ValueError: an unknown mode (named).
    """
    fns = {"marker": reward, "last_number": lenient_reward}
    if extraction not in fns:
        raise ValueError(f"data.answer_extraction={extraction!r} must be one of {list(fns)}")
    return fns[extraction]
