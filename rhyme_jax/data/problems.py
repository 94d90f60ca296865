"""The problem record shared by every dataset, and the error raised for bad dataset input."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class DataError(ValueError):
    """Bad dataset input or data configuration.

    The message names the offending file and 1-based line number (``path:line``) and the field,
    or the config field (e.g. ``data.source``) for configuration errors.
    """


@dataclass(frozen=True)
class Problem:
    """One math word problem with a verifiable final answer.

    Attributes:
      id: stable integer id; the index of the problem in its split (unique within a split).
      question: the problem statement shown to the policy.
      solution: worked solution text ending in ``"#### <answer>"`` (GSM8K format).
      answer: canonical final answer string, e.g. ``"42"`` (GSM8K: thousands commas removed).
      metadata: extra record fields for the reward function (``data.metadata_fields`` of a
        ``jsonl`` / ``parquet`` dataset; empty for the built-in datasets). Not part of the hash.
    """

    id: int
    question: str
    solution: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict, hash=False)
