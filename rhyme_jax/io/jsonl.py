"""JSON lines: one reader for every ``.jsonl`` file (metrics, GSM8K, your own data, replay cases).

Each non-blank line is one JSON value; blank lines are skipped; lines are numbered from 1 as in an
editor, so every record and every error names ``<path>:<line>``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple


class JsonlError(ValueError):
    """A line of a JSON-lines file is not valid JSON, or the file is not UTF-8 text.

    The message is ``"<path>:<line>: <reason>"``.

    Attributes:
      path: the file (``Path``).
      lineno: 1-based line number.
      where: ``"<path>:<line>"``.
      kind: ``"json"`` (the line does not parse) or ``"utf-8"`` (the bytes do not decode).
      detail: what is wrong, e.g. ``"Expecting value at column 7"`` (JSON: the decoder's message and
        1-based column) or the codec's reason.
      reason: ``"not valid JSON (<detail>)"`` or ``"not UTF-8 text (<detail>)"``.
    """

    def __init__(self, path: Path, lineno: int, kind: str, detail: str):
        self.path, self.lineno, self.kind, self.detail = path, lineno, kind, detail
        self.where = f"{path}:{lineno}"
        self.reason = f"{'not valid JSON' if kind == 'json' else 'not UTF-8 text'} ({detail})"
        super().__init__(f"{self.where}: {self.reason}")


class JsonLine(NamedTuple):
    """One parsed line: the file, its 1-based line number and the JSON value (any JSON type)."""

    path: Path
    lineno: int
    value: Any

    @property
    def where(self) -> str:
        """``"<path>:<line>"``, the prefix of every message about this record."""
        return f"{self.path}:{self.lineno}"


def parse_jsonl(lines: Iterable[str], path: str | Path) -> Iterator[JsonLine]:
    """Parse text lines already read (line i of ``lines`` is line i + 1 of ``path``), lazily.

    Args:
      lines: the file's lines, with or without their ``"\\n"``.
      path: the file they came from (named in records and errors).

    Yields:
      ``JsonLine`` of each non-blank line, in order.

    Raises:
      JsonlError: a non-blank line is not valid JSON (``kind="json"``), raised when it is reached.
    """
    path = Path(path)
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line.rstrip("\n"))
        except json.JSONDecodeError as exc:
            raise JsonlError(path, lineno, "json", f"{exc.msg} at column {exc.colno}") from None
        yield JsonLine(path, lineno, value)


def read_jsonl(path: str | Path) -> Iterator[JsonLine]:
    """Read a UTF-8 JSON-lines file lazily, one ``JsonLine`` per non-blank line.

    The file is opened now (a missing file raises here, not at the first record) and closed when
    the iterator is exhausted or closed.

    Args:
      path: the ``.jsonl`` file.

    Returns:
      An iterator of ``JsonLine`` (path, 1-based line number, JSON value), in file order.

    Raises:
      OSError: the file cannot be opened (``FileNotFoundError`` when it does not exist).
      JsonlError: while iterating, a non-blank line is not valid JSON (``kind="json"``) or the
        bytes are not UTF-8 (``kind="utf-8"``, naming the line being read when decoding failed:
        the decoder reads ahead in chunks, so the bad bytes may lie a few lines further on); the
        message names ``<path>:<line>``.
    """
    path = Path(path)
    return _records(path, path.open("r", encoding="utf-8"))


def _records(path: Path, fh) -> Iterator[JsonLine]:
    """``parse_jsonl`` over the open text file ``fh``; closes ``fh``."""
    with fh:
        yield from parse_jsonl(_decoded(fh, path), path)


def _decoded(fh, path: Path) -> Iterator[str]:
    """The lines of ``fh``; a decoding error becomes a ``JsonlError`` naming the line being read."""
    lineno = 0
    try:
        for lineno, line in enumerate(fh, start=1):
            yield line
    except UnicodeDecodeError as exc:
        raise JsonlError(path, lineno + 1, "utf-8", exc.reason) from None
