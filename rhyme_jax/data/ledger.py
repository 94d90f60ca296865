"""The long-tailed reasoning task: a ledger of entries whose balance is worked out line by line.

A problem starts a balance in ``[0, 99]`` and lists ``N`` numbered entries ``i:+d`` / ``i:-d``
(``d`` in ``1..9``); the worked solution applies them one numbered line each (``"1: 37+5=42"``)
and ends with a GSM8K-style ``"#### <balance>"``. Every line needs the previous line's balance
and entry ``i`` of the question (the number makes the lookup a match, not a count), so the response grows with ``N`` and one slip anywhere makes the answer
wrong: long responses are both the slowest to sample and the hardest to get right, the regime of
RhymeRL's reasoning rollouts (arXiv 2508.18588 s.2: responses of 2K-11K+ tokens with a long
right tail).

``N`` is long-tailed: ``N = floor(min_steps * u ** (-1 / tail_index))`` with ``u`` uniform on
``(0, 1]`` (a Pareto law with scale ``data.min_steps`` and index ``data.tail_index``), capped at
``data.max_steps``. With ``min_steps=4``, ``tail_index=1.1``, ``max_steps=800``: median about 7
entries, 1% of problems above 260, the longest worked solutions several thousand tokens. Balances
stay in ``[0, 99]`` (an entry's sign is forced where the other would leave the range). The train
and eval splits are disjoint by question text (``synthetic.bucket_is_eval``).
"""

from __future__ import annotations

import random

from rhyme_jax.data.problems import DataError, Problem
from rhyme_jax.data.synthetic import SPLITS, bucket_is_eval

MAX_BALANCE = 99


def entry_count(rng: random.Random, min_steps: int, max_steps: int, tail_index: float) -> int:
    """One problem's number of entries: Pareto(scale ``min_steps``, index ``tail_index``), floored
    and capped at ``max_steps``."""
    u = 1.0 - rng.random()  # (0, 1]
    return min(max_steps, int(min_steps * u ** (-1.0 / tail_index)))


def one_ledger(rng: random.Random, entries: int) -> tuple[str, list[str], int]:
    """``(question, solution lines, final balance)`` of one ledger with ``entries`` entries."""
    balance = start = rng.randint(0, MAX_BALANCE)
    question_entries, lines = [], []
    for i in range(1, entries + 1):
        d = rng.randint(1, 9)
        sign = rng.choice("+-")
        if balance + d > MAX_BALANCE:
            sign = "-"
        elif balance - d < 0:
            sign = "+"
        new = balance + d if sign == "+" else balance - d
        question_entries.append(f"{i}:{sign}{d}")
        lines.append(f"{i}: {balance}{sign}{d}={new}")
        balance = new
    question = f"Start at {start}. Apply: {' '.join(question_entries)}. What is the final balance?"
    return question, lines, balance


def make_ledger_problems(seed: int, split: str, n: int, *, min_steps: int = 4, max_steps: int = 800,
                         tail_index: float = 1.1) -> list[Problem]:
    """Generate ``n`` distinct ledger problems of one split.

    Args:
      seed: RNG seed; the output is a pure function of all arguments.
      split: ``"train"`` or ``"eval"``; the two splits never share a question text.
      n: number of problems (>= 0).
      min_steps, max_steps, tail_index: the law of the entry count (module docstring).

    Returns:
      ``n`` problems with ids ``0..n-1``: solutions like ``"1: 37+5=42\\n2: 42-3=39\\n#### 39"``,
      ``answer`` the final balance.

    Raises:
      DataError: unknown split, negative ``n``, a law parameter out of range (names the
        ``data.*`` field), or too few distinct questions for ``n``.
    """
    if split not in SPLITS:
        raise DataError(f"ledger split must be one of {SPLITS}, got {split!r}")
    if n < 0:
        raise DataError(f"number of ledger problems must be >= 0, got {n}")
    if min_steps < 1 or max_steps < min_steps:
        raise DataError(f"data.min_steps ({min_steps}) must be >= 1 and <= data.max_steps ({max_steps})")
    if tail_index <= 0:
        raise DataError(f"data.tail_index must be > 0, got {tail_index}")
    rng = random.Random(f"rhyme-jax-ledger/{seed}/{split}")
    seen: set[str] = set()
    out: list[Problem] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 200 * n + 1000:
            raise DataError(f"could only generate {len(out)} of {n} distinct ledger {split} problems; "
                            "raise data.min_steps")
        question, lines, value = one_ledger(rng, entry_count(rng, min_steps, max_steps, tail_index))
        if bucket_is_eval(question) != (split == "eval") or question in seen:
            continue
        seen.add(question)
        out.append(Problem(id=len(out), question=question, solution="\n".join(lines + [f"#### {value}"]),
                           answer=str(value)))
    return out
