"""The held-out evaluation before GRPO is computed once per warm start and read back by the next
unit with the same key (``rhyme_lab/ablate/before_eval.py``); any change of what the greedy
responses depend on misses the cache."""

from __future__ import annotations

import os

import numpy as np

from rhyme_jax.config import load_config
from rhyme_jax.train.evaluate import EvalResult
from rhyme_lab.ablate import before_eval
from rhyme_lab.ablate.registry import ROOT


class _Trainer:
    def __init__(self):
        self.calls = 0

    def evaluate(self):
        self.calls += 1
        return EvalResult(accuracy=0.5, stderr=0.25, n=4, mean_length=12.5,
                          correct=np.array([1.0, 0.0, 1.0, 0.0]))


def _cfg(params, *sets):
    return load_config(ROOT / "configs/longtail.yaml", [f"run.init_from={params}", "run.eval_samples=0", *sets])


def test_second_unit_reads_the_first_units_evaluation_and_a_changed_key_misses(tmp_path):
    params = tmp_path / "sft" / "params"
    params.mkdir(parents=True)
    (params / "w.bin").write_bytes(b"\0" * 8)
    first, second = _Trainer(), _Trainer()
    a = before_eval.before_eval(first, _cfg(params))
    b = before_eval.before_eval(second, _cfg(params, "run.seed=1"))  # greedy: the run seed does not matter
    assert (first.calls, second.calls) == (1, 0)
    assert b.accuracy == a.accuracy and b.n == 4 and b.mean_length == 12.5
    np.testing.assert_array_equal(b.correct, a.correct)
    assert b.sampled_per_problem is None
    assert before_eval.cache_path(_cfg(params)).parent == tmp_path / "sft" / "held_out_before"
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    named = [before_eval.cache_key(_cfg(p, f"model.tokenizer_path={t}"))
             for p, t in ((params, tok), (os.path.relpath(params), os.path.relpath(tok)))]
    assert named[0] == named[1]  # the same warm start and tokenizer named relative or absolute

    third = _Trainer()
    before_eval.before_eval(third, _cfg(params, "data.num_eval=8"))  # another eval set
    (params / "w.bin").write_bytes(b"\1" * 9)  # another warm start
    before_eval.before_eval(third, _cfg(params))
    before_eval.before_eval(third, _cfg(params, "run.eval_samples=2", "run.seed=1"))  # sampled: seed counts
    before_eval.before_eval(third, _cfg(params, "run.eval_samples=2", "run.seed=2"))
    assert third.calls == 4


def test_no_warm_start_evaluates_and_stores_nothing(tmp_path):
    t = _Trainer()
    cfg = load_config(ROOT / "configs/longtail.yaml", ["run.eval_samples=0"])
    assert before_eval.cache_path(cfg) is None
    before_eval.before_eval(t, cfg)
    before_eval.before_eval(t, cfg)
    assert t.calls == 2
