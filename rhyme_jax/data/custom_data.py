"""Your own dataset: ``data.source: jsonl`` or ``parquet`` with a field mapping (docs/custom_data.md).

Each record (a JSON object per line, or a Parquet row) gives one ``Problem``:

* ``question``: the record's ``data.prompt_field`` (a non-empty string), the text that replaces
  ``{question}`` in ``model.prompt_template``;
* ``answer``: the record's ``data.answer_field``: GSM8K style ``"<reasoning> #### 42"`` (the
  final answer after the last ``####``, as ``gsm8k.canonical_gsm8k_answer`` normalises it) or a
  plain answer (a string, or a JSON number): a numeric one normalised the same way
  (``"1,000"`` -> ``"1000"``, ``"$7"`` -> ``"7"``), any other text kept as written (stripped);
* ``solution``: the GSM8K-style answer text itself, else ``"#### <answer>"`` (what the SFT warm
  start trains on);
* ``metadata``: the record's ``data.metadata_fields`` (any JSON values), which a reward function
  reads as ``problem.metadata[name]``.

Relative paths are resolved from the working directory. Every error is one ``DataError`` line
naming ``<file>:<line>`` (Parquet: ``<file>: row <n>``) and the field.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

from rhyme_jax.config import DataSection
from rhyme_jax.data.gsm8k import canonical_gsm8k_answer
from rhyme_jax.data.problems import DataError, Problem
from rhyme_jax.io.jsonl import JsonlError, read_jsonl

USER_SOURCES = ("jsonl", "parquet")
_NUMERIC = re.compile(r"[-+]?\d+(?:\.\d+)?(?:/\d+)?")


def split_answer(text: str) -> tuple[str, str]:
    """``(solution, answer)`` of an answer field's text (module docstring).

    Raises:
      ValueError: no final answer (empty text, or nothing after ``####``); the message says which.
    """
    if "####" in text:
        final = canonical_gsm8k_answer(text.rsplit("####", 1)[1])
        if not final:
            raise ValueError("has an empty final answer after '####'")
        return text, final
    plain = text.strip()
    numeric = canonical_gsm8k_answer(plain)
    final = numeric if _NUMERIC.fullmatch(numeric) else plain
    if not final:
        raise ValueError("is empty")
    return f"#### {final}", final


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    """``("<path>:<line>", record)`` of each non-blank line of a JSONL file (``io.jsonl.read_jsonl``).

    Raises:
      DataError: a line is not valid JSON (or not UTF-8); the message names ``<path>:<line>``.
    """
    try:
        for record in read_jsonl(path):
            yield record.where, record.value
    except JsonlError as exc:
        raise DataError(str(exc)) from None


def _parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    """``("<path>: row <n>", record)`` of each row of a Parquet file (1-based rows).

    Raises:
      DataError: pyarrow is not installed, or the file is not Parquet.
    """
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("data.source='parquet' needs pyarrow: pip install pyarrow (or export the data "
                        "to JSONL and use data.source=jsonl)") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise DataError(f"{path}: not a readable Parquet file ({' '.join(str(exc).split())})") from None
    for i, row in enumerate(rows, start=1):
        yield f"{path}: row {i}", row


def _field(record: dict, name: str, key: str, where: str) -> Any:
    """``record[name]``, or a DataError naming the field and the config key that names it."""
    if name not in record:
        raise DataError(f"{where}: missing field {name!r} ({key}); the record has {sorted(record)[:8]}")
    return record[name]


def problem_from_record(record: Any, where: str, index: int, data_cfg: DataSection) -> Problem:
    """The ``Problem`` of one record (module docstring); ``where`` is ``<file>:<line>``.

    Raises:
      DataError: not a JSON object, a mapped field missing, a prompt that is not a non-empty
        string, an answer that is not a string or number or has no final answer.
    """
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    question = _field(record, data_cfg.prompt_field, "data.prompt_field", where)
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{where}: field {data_cfg.prompt_field!r} (data.prompt_field) must be a non-empty "
                        f"string, got {question!r:.60}")
    answer = _field(record, data_cfg.answer_field, "data.answer_field", where)
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DataError(f"{where}: field {data_cfg.answer_field!r} (data.answer_field) must be a string or "
                        f"a number, got {type(answer).__name__}")
    try:
        solution, final = split_answer(str(answer))
    except ValueError as exc:
        raise DataError(f"{where}: field {data_cfg.answer_field!r} (data.answer_field) {exc}") from None
    metadata = {name: _field(record, name, "data.metadata_fields", where) for name in data_cfg.metadata_fields}
    return Problem(id=index, question=question, solution=solution, answer=final, metadata=metadata)


def load_user_problems(path: str | Path, data_cfg: DataSection) -> list[Problem]:
    """Problems of one JSONL or Parquet file (``data_cfg.source``), in file order.

    Args:
      path: the file (relative paths from the working directory).
      data_cfg: the ``data`` section: ``source`` (``"jsonl"`` / ``"parquet"``), ``prompt_field``,
        ``answer_field``, ``metadata_fields``.

    Returns:
      Problems with ``id`` the 0-based index among the file's records.

    Raises:
      DataError: the file is missing or has no records, a line / row is bad (named
        ``<file>:<line>`` and field), or parquet without pyarrow.
    """
    path = Path(path)
    source = data_cfg.source
    if source not in USER_SOURCES:
        raise DataError(f"data.source={source!r}: load_user_problems reads {list(USER_SOURCES)}")
    if not path.is_file():
        raise DataError(f"{path}: data file not found (data.source={source!r}; a relative path is read "
                        f"from the working directory {Path.cwd()})")
    records = _jsonl_records(path) if source == "jsonl" else _parquet_records(path)
    problems = [problem_from_record(rec, where, i, data_cfg) for i, (where, rec) in enumerate(records)]
    if not problems:
        raise DataError(f"{path}: no records (empty file)")
    return problems
