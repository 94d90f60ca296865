"""Datasets (GSM8K jsonl, the embedded synthetic arithmetic task, your own JSONL / Parquet files)
and rewards (the built-in verifier, or your own ``reward.fn``)."""

from __future__ import annotations

from rhyme_jax.config import DataSection
from rhyme_jax.data.custom_data import USER_SOURCES, load_user_problems
from rhyme_jax.data.custom_reward import RewardError, choose_reward, load_reward, score_batch, task_reward
from rhyme_jax.data.gsm8k import GSM8K_DIR, gsm8k_path, load_gsm8k
from rhyme_jax.data.ledger import make_ledger_problems
from rhyme_jax.data.problems import DataError, Problem
from rhyme_jax.data.rewards import answers_match, extract_answer, reward
from rhyme_jax.data.synthetic import corpus, make_problems

SOURCES = ("synthetic", "ledger", "gsm8k") + USER_SOURCES

__all__ = [
    "DataError", "GSM8K_DIR", "Problem", "RewardError", "SOURCES", "answers_match", "choose_reward", "corpus",
    "extract_answer", "gsm8k_path", "load_gsm8k", "make_ledger_problems", "load_problems", "load_reward", "load_user_problems",
    "make_problems", "reward", "score_batch", "task_reward",
]


def load_problems(data_cfg: DataSection) -> tuple[list[Problem], list[Problem]]:
    """Train and held-out eval problems for a run's ``data`` config section.

    Args:
      data_cfg: the run config's ``DataSection`` (``cfg.data``). ``source == "synthetic"``
        uses ``seed, num_train, num_eval, min_steps, max_steps, max_number``; ``"ledger"`` the
        long-tailed ledger task (``data/ledger.py``: ``min_steps, max_steps, tail_index``); ``"gsm8k"`` reads
        ``train_path`` and ``test_path`` (the test split serves as eval); an empty path means the
        GSM8K copy vendored with the package (``gsm8k_path``); ``"jsonl"`` / ``"parquet"`` read
        ``train_path`` and ``test_path`` with the field mapping ``prompt_field``,
        ``answer_field``, ``metadata_fields`` (``custom_data.load_user_problems``).

    Returns:
      ``(train, eval)``; the eval list has at most ``data_cfg.num_eval`` problems (a prefix, so
      ids stay stable). ``num_eval <= 0`` gives an empty eval list.

    Raises:
      DataError: unknown ``data.source``, ``data.num_train`` < 0, or any loader error (a missing
        file, or a bad line: the message names file:line).
    """
    source = data_cfg.source
    num_eval = max(int(data_cfg.num_eval), 0)
    if source == "synthetic":
        if int(data_cfg.num_train) < 0:
            raise DataError(f"data.num_train must be >= 0, got {data_cfg.num_train}")
        kw = dict(min_steps=int(data_cfg.min_steps), max_steps=int(data_cfg.max_steps),
                  max_number=int(data_cfg.max_number))
        seed = int(data_cfg.seed)
        train = make_problems(seed, "train", int(data_cfg.num_train), **kw)
        evals = make_problems(seed, "eval", num_eval, **kw)
        return train, evals
    if source == "ledger":
        kw = dict(min_steps=int(data_cfg.min_steps), max_steps=int(data_cfg.max_steps),
                  tail_index=float(data_cfg.tail_index))
        return (make_ledger_problems(data_cfg.seed, "train", int(data_cfg.num_train), **kw),
                make_ledger_problems(data_cfg.seed, "eval", num_eval, **kw))
    if source == "gsm8k":
        train = load_gsm8k(gsm8k_path("train", data_cfg.train_path or ""))
        evals = load_gsm8k(gsm8k_path("test", data_cfg.test_path or ""))[:num_eval]
        return train, evals
    if source in USER_SOURCES:
        train = load_user_problems(data_cfg.train_path, data_cfg)
        evals = load_user_problems(data_cfg.test_path, data_cfg)[:num_eval]
        return train, evals
    raise DataError(f"data.source must be one of {SOURCES}, got {source!r}")
