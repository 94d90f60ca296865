"""The long-tailed ledger task (``data/ledger.py``, ``data.source: ledger``)."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from rhyme_jax.config import load_config
from rhyme_jax.data import DataError, extract_answer, load_problems, make_ledger_problems, reward
from rhyme_jax.data.ledger import entry_count


def _replay(problem) -> int:
    """The balance the question's entries give, computed from the question text alone."""
    start = int(re.match(r"Start at (\d+)\.", problem.question).group(1))
    entries = re.findall(r"(\d+):([+-]\d)", problem.question)
    assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
    return start + sum(int(d) for _, d in entries)


def test_solutions_are_correct_numbered_and_in_range():
    probs = make_ledger_problems(3, "train", 300, min_steps=2, max_steps=50, tail_index=1.0)
    for p in probs:
        lines = p.solution.split("\n")
        assert lines[-1] == f"#### {p.answer}" and int(p.answer) == _replay(p)
        balance = int(re.match(r"Start at (\d+)\.", p.question).group(1))
        for i, line in enumerate(lines[:-1], 1):
            m = re.fullmatch(r"(\d+): (\d+)([+-])(\d)=(\d+)", line)
            assert m and int(m.group(1)) == i and int(m.group(2)) == balance
            balance = balance + int(m.group(4)) * (1 if m.group(3) == "+" else -1)
            assert int(m.group(5)) == balance and 0 <= balance <= 99
        assert reward(p.solution, p) == 1.0 and extract_answer(p.solution) == p.answer


def test_entry_count_follows_the_pareto_law():
    """P(N >= k) = (min_steps / k) ** tail_index below the cap: at k = 4 x min_steps and
    tail_index 1, 1/4 of draws; the binomial standard error over 20,000 draws is 0.003."""
    rng = random.Random(0)
    n = np.array([entry_count(rng, 5, 10_000, 1.0) for _ in range(20_000)])
    assert n.min() == 5
    assert abs(np.mean(n >= 20) - 0.25) < 5 * 0.003
    assert abs(np.mean(n >= 100) - 0.05) < 5 * 0.0016
    capped = [entry_count(rng, 5, 40, 1.0) for _ in range(2000)]
    assert max(capped) == 40


def test_splits_are_disjoint_and_deterministic():
    a = make_ledger_problems(0, "train", 200, min_steps=3, max_steps=30)
    b = make_ledger_problems(0, "train", 200, min_steps=3, max_steps=30)
    e = make_ledger_problems(0, "eval", 100, min_steps=3, max_steps=30)
    assert [p.question for p in a] == [p.question for p in b]
    assert not {p.question for p in a} & {p.question for p in e}


def test_config_selects_it_and_checks_the_law(tmp_path):
    cfg = load_config(None, ["data.source=ledger", "data.num_train=20", "data.num_eval=5", "data.min_steps=3",
                             "data.max_steps=40"])
    train, evals = load_problems(cfg.data)
    assert len(train) == 20 and len(evals) == 5 and train[0].question.startswith("Start at ")
    with pytest.raises(Exception, match="tail_index"):
        load_config(None, ["data.source=ledger", "data.tail_index=0"])
    with pytest.raises(DataError, match="data.min_steps"):
        make_ledger_problems(0, "train", 1, min_steps=0)
