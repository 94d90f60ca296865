"""The embedded CPU-demo task: GSM8K-style multi-step arithmetic word problems.

Every problem tracks one quantity (a person's objects) through ``min_steps..max_steps``
arithmetic steps with operators ``+ - *``; the worked solution is one equation per step and a
GSM8K-style final line, e.g. ``"5 + 3 = 8\\n8 - 2 = 6\\n#### 6"``. Operands are drawn from
``[1, max_number]`` (multipliers from 2..3, or 2..9 for "k boxes of m") and every intermediate
result is a non-negative integer in ``[0, MAX_RESULT]``.

The train and eval splits are disjoint by construction: a question belongs to the eval split iff
``sha256(question) mod EVAL_BUCKETS == 0``; each split draws candidates from its own seeded RNG
and keeps only questions of its bucket, so no eval question text can appear in train (for any seed).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from rhyme_jax.data.problems import DataError, Problem

MAX_RESULT = 99  # every intermediate and final result lies in [0, MAX_RESULT]
EVAL_BUCKETS = 10  # 1/EVAL_BUCKETS of the question space belongs to the eval split
SPLITS = ("train", "eval")


@dataclass(frozen=True)
class _Person:
    name: str
    subj: str  # he / she
    obj: str  # him / her
    poss: str  # his / her


_PEOPLE = tuple(
    _Person(n, *(("he", "him", "his") if g == "m" else ("she", "her", "her")))
    for n, g in [
        ("Ava", "f"), ("Ben", "m"), ("Chloe", "f"), ("David", "m"), ("Emma", "f"), ("Felix", "m"),
        ("Grace", "f"), ("Henry", "m"), ("Isla", "f"), ("Jack", "m"), ("Kate", "f"), ("Leo", "m"),
        ("Mia", "f"), ("Noah", "m"), ("Olivia", "f"), ("Paul", "m"), ("Rosa", "f"), ("Sam", "m"),
        ("Tara", "f"), ("Victor", "m"), ("Wendy", "f"), ("Yusuf", "m"), ("Zoe", "f"), ("Omar", "m"),
    ]
)
_OBJECTS = (
    "apples", "marbles", "stickers", "pencils", "cookies", "books", "coins", "shells", "cards",
    "stamps", "balloons", "candies", "toy cars", "buttons", "flowers", "eggs", "beads", "oranges",
)
_CONTAINERS = ("boxes", "bags", "jars", "baskets", "packs", "crates")
_TIMES_WORD = {2: "doubles", 3: "triples"}


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _start_text(rng: random.Random, p: _Person, a: int, thing: str) -> str:
    return rng.choice([
        f"{p.name} has {a} {thing}.",
        f"{p.name} starts with {a} {thing}.",
        f"There are {a} {thing} in {p.name}'s bag.",
        f"{p.name} owns {a} {thing}.",
    ])


def _boxes_text(rng: random.Random, p: _Person, k: int, m: int, thing: str) -> str:
    box = rng.choice(_CONTAINERS)
    return rng.choice([
        f"{p.name} has {k} {box} of {thing}, and each of the {k} {box} holds {m} {thing}.",
        f"{p.name} buys {k} {box} with {m} {thing} in each.",
        f"Each of {p.name}'s {k} {box} holds {m} {thing}.",
    ])


def _add_text(rng: random.Random, p: _Person, friend: _Person, b: int, thing: str) -> str:
    return rng.choice([
        f"{_cap(p.subj)} buys {b} more {thing}.",
        f"{friend.name} gives {p.obj} {b} {thing}.",
        f"{_cap(p.subj)} finds {b} more {thing}.",
        f"Then {p.subj} gets {b} more {thing} as a gift.",
    ])


def _sub_text(rng: random.Random, p: _Person, friend: _Person, b: int, thing: str) -> str:
    return rng.choice([
        f"{_cap(p.subj)} gives away {b} {thing}.",
        f"{_cap(p.subj)} gives {b} {thing} to {friend.name}.",
        f"{_cap(p.subj)} sells {b} of {p.poss} {thing}.",
        f"{_cap(p.subj)} loses {b} {thing}.",
    ])


def _mul_text(rng: random.Random, p: _Person, k: int, thing: str) -> str:
    options = [f"{_cap(p.subj)} ends up with {k} times as many {thing} as before."]
    if k in _TIMES_WORD:
        options.append(f"Then the number of {thing} {p.name} has {_TIMES_WORD[k]}.")
    return rng.choice(options)


def _one_problem(rng: random.Random, steps: int, max_number: int) -> tuple[str, list[str], int]:
    """Draw one problem: (question, solution equation lines, final answer)."""
    p = rng.choice(_PEOPLE)
    friend = rng.choice([q for q in _PEOPLE if q is not p])
    thing = rng.choice(_OBJECTS)
    sentences: list[str] = []
    lines: list[str] = []
    top = min(max_number, MAX_RESULT)

    # Step 1: "k boxes of m" (a multiplication) or a starting amount followed by + / -.
    if rng.random() < 0.35:
        k = rng.randint(2, min(9, top))
        m = rng.randint(2, max(2, min(top, MAX_RESULT // k)))
        v = k * m
        sentences.append(_boxes_text(rng, p, k, m, thing))
        lines.append(f"{k} * {m} = {v}")
        remaining = steps - 1
    else:
        v = rng.randint(1, top)
        sentences.append(_start_text(rng, p, v, thing))
        remaining = steps

    for _ in range(remaining):
        ops = []
        if v < MAX_RESULT:
            ops += ["+", "+"]
        if v >= 1:
            ops += ["-", "-"]
        if 1 <= v and 2 * v <= MAX_RESULT:
            ops.append("*")
        op = rng.choice(ops)
        if op == "+":
            b = rng.randint(1, min(top, MAX_RESULT - v))
            sentences.append(_add_text(rng, p, friend, b, thing))
            new = v + b
        elif op == "-":
            b = rng.randint(1, min(top, v))
            sentences.append(_sub_text(rng, p, friend, b, thing))
            new = v - b
        else:
            b = rng.randint(2, min(3, MAX_RESULT // v))
            sentences.append(_mul_text(rng, p, b, thing))
            new = v * b
        lines.append(f"{v} {op} {b} = {new}")
        v = new

    ends = [f"How many {thing} does {p.name} have now?", f"How many {thing} does {p.name} have in the end?"]
    if lines and lines[-1].split()[1] == "-":
        ends.append(f"How many {thing} does {p.name} have left?")
    end = rng.choice(ends)
    return " ".join(sentences + [end]), lines, v


def bucket_is_eval(question: str) -> bool:
    """True iff ``question`` belongs to the eval split: ``sha256(question) mod EVAL_BUCKETS == 0``
    (disjoint splits for every generated task, whatever the seed)."""
    digest = hashlib.sha256(question.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % EVAL_BUCKETS == 0


def make_problems(
    seed: int, split: str, n: int, *, min_steps: int = 2, max_steps: int = 4, max_number: int = 20
) -> list[Problem]:
    """Generate ``n`` distinct synthetic arithmetic word problems for one split.

    Args:
      seed: RNG seed; the output is a pure function of all arguments.
      split: ``"train"`` or ``"eval"``; the two splits never share a question text.
      n: number of problems (>= 0).
      min_steps, max_steps: equations per solution, drawn uniformly from ``[min_steps, max_steps]``.
      max_number: operands are drawn from ``[1, max_number]`` (results stay in ``[0, 99]``).

    Returns:
      ``n`` problems with ids ``0..n-1``, distinct questions, solutions like
      ``"5 + 3 = 8\\n8 - 2 = 6\\n#### 6"`` and ``answer`` the final integer as a string.

    Raises:
      DataError: unknown split, negative ``n``, ``min_steps``/``max_steps``/``max_number`` out of
        range (names the ``data.*`` field), or the question space is too small for ``n``.
    """
    if split not in SPLITS:
        raise DataError(f"synthetic split must be one of {SPLITS}, got {split!r}")
    if n < 0:
        raise DataError(f"number of synthetic problems must be >= 0, got {n}")
    if min_steps < 1:
        raise DataError(f"data.min_steps must be >= 1, got {min_steps}")
    if max_steps < min_steps:
        raise DataError(f"data.max_steps ({max_steps}) must be >= data.min_steps ({min_steps})")
    if max_number < 2:
        raise DataError(f"data.max_number must be >= 2, got {max_number}")
    rng = random.Random(f"rhyme-jax-synthetic/{seed}/{split}")
    want_eval = split == "eval"
    seen: set[str] = set()
    out: list[Problem] = []
    attempts, budget = 0, 200 * n + 1000
    while len(out) < n:
        attempts += 1
        if attempts > budget:
            raise DataError(
                f"could only generate {len(out)} of {n} distinct {split} problems; "
                "raise data.max_number or data.max_steps"
            )
        question, lines, value = _one_problem(rng, rng.randint(min_steps, max_steps), max_number)
        if bucket_is_eval(question) != want_eval or question in seen:
            continue
        seen.add(question)
        solution = "\n".join(lines + [f"#### {value}"])
        out.append(Problem(id=len(out), question=question, solution=solution, answer=str(value)))
    return out


def corpus(problems: list[Problem]) -> list[str]:
    """Texts for tokenizer training: each problem's question then its solution, in order."""
    texts: list[str] = []
    for p in problems:
        texts.append(p.question)
        texts.append(p.solution)
    return texts
