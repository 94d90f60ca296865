"""GSM8K loader (Cobbe et al. 2021, https://github.com/openai/grade-school-math).

Each line of the jsonl files is ``{"question": str, "answer": "<reasoning>\\n#### <final>"}``.
The reasoning contains calculator annotations ``<<48/2=24>>`` which are kept verbatim in
``Problem.solution``; the canonical answer is the text after the last ``####`` with thousands
commas removed (``"1,000"`` -> ``"1000"``).

Both splits ship with the package (``gsm8k_data/``, MIT license, notice in ``gsm8k_data/LICENSE``);
``gsm8k_path`` returns the file a config's ``data.train_path`` / ``data.test_path`` names, or the
vendored split when the field is empty.
"""

from __future__ import annotations

from pathlib import Path

from rhyme_jax.data.problems import DataError, Problem
from rhyme_jax.io.jsonl import JsonlError, read_jsonl

GSM8K_DIR = Path(__file__).resolve().with_name("gsm8k_data")  # vendored train.jsonl, test.jsonl
SPLITS = ("train", "test")


def gsm8k_path(split: str, path: str | Path = "") -> Path:
    """The GSM8K file of ``split``: ``path`` when set (relative to the working directory, as given),
    else the vendored copy ``GSM8K_DIR / f"{split}.jsonl"``.

    Raises:
      DataError: ``split`` is not ``"train"`` or ``"test"``.
    """
    if split not in SPLITS:
        raise DataError(f"GSM8K split must be one of {SPLITS}, got {split!r}")
    return Path(path) if str(path) else GSM8K_DIR / f"{split}.jsonl"


def canonical_gsm8k_answer(final: str) -> str:
    """Canonical form of a GSM8K final answer: stripped, thousands commas and a ``$`` removed."""
    return final.strip().replace(",", "").lstrip("$").strip()


def load_gsm8k(path: str | Path) -> list[Problem]:
    """Load a GSM8K jsonl split.

    Args:
      path: a ``.jsonl`` file, one JSON object per line with string fields ``"question"`` and
        ``"answer"`` (``"<reasoning> #### <final>"``). Blank lines are skipped.

    Returns:
      Problems in file order; ``Problem.id`` is the 0-based index among the loaded problems.

    Raises:
      DataError: the file is missing or not UTF-8, a line is not valid JSON or not an object, a
        field is missing or not a string, or the answer has no ``####`` / an empty final answer. The
        message starts with ``"<path>:<line>:"`` (1-based line) and names the field.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: GSM8K file not found")
    problems: list[Problem] = []
    try:
        for record in read_jsonl(path):
            problems.append(_problem(record.value, record.where, len(problems)))
    except JsonlError as exc:
        if exc.kind == "json":
            raise DataError(f"{exc.where}: invalid JSON ({exc.detail})") from None
        raise DataError(str(exc)) from None
    return problems


def _problem(obj, where: str, index: int) -> Problem:
    """The ``Problem`` of one GSM8K record (``where`` = ``"<path>:<line>"``; see ``load_gsm8k``)."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("question", "answer"):
        if key not in obj:
            raise DataError(f"{where}: missing field {key!r}")
        if not isinstance(obj[key], str):
            raise DataError(f"{where}: field {key!r} must be a string, got {type(obj[key]).__name__}")
    solution = obj["answer"]
    if "####" not in solution:
        raise DataError(f"{where}: field 'answer' has no '#### <final answer>' marker")
    final = canonical_gsm8k_answer(solution.rsplit("####", 1)[1])
    if not final:
        raise DataError(f"{where}: field 'answer' has an empty final answer after '####'")
    return Problem(id=index, question=obj["question"], solution=solution, answer=final)
