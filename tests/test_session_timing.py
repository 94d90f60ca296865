"""``ablate.session._timed``: a compared rollout that paid a one-time cost (XLA compiles, or the
drafter's numba kernels compiled on a fresh checkout, which land in its host drafting time) is
replayed on the same inputs and the replay's timing kept; a call without one is timed once."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

from rhyme_lab.ablate import session


class _Engine:
    """``generate`` stand-in: sleeps ``walls[i]`` and reports ``drafting[i]`` host drafting seconds."""

    def __init__(self, walls, drafting):
        self.walls, self.drafting, self.calls = list(walls), list(drafting), 0

    def generate(self, state, prompts, sp, key, drafter=None):
        i = self.calls
        self.calls += 1
        time.sleep(self.walls[i])
        stats = {"generated_tokens": 4.0, "seconds": self.walls[i], "drafting_seconds": self.drafting[i]}
        return SimpleNamespace(stats=stats, tokens=[np.zeros(2, np.int32)] * len(prompts))


class _Drafter:
    def batch(self, rows):
        return rows


def _setup(engine):
    return session._Setup(cfg=None, engine=engine, state=None, rows=np.arange(2), prompts=[[1], [2]],
                          reward=None, run_dir=None)


def test_a_call_that_compiled_its_drafter_is_replayed():
    eng = _Engine(walls=(0.2, 0.05), drafting=(0.15, 0.001))  # the first call's drafting is mostly JIT
    _, stats = session._timed(_setup(eng), np.arange(2), None, None, drafter=_Drafter())
    assert eng.calls == 2 and stats["replayed"] and stats["drafting_seconds"] == 0.001


def test_a_call_without_one_time_costs_is_timed_once():
    eng = _Engine(walls=(0.2, 0.2), drafting=(0.001, 0.001))
    _, stats = session._timed(_setup(eng), np.arange(2), None, None, drafter=_Drafter())
    assert eng.calls == 1 and not stats["replayed"]
    eng = _Engine(walls=(0.2, 0.05), drafting=(0.15, 0.001))
    _, stats = session._timed(_setup(eng), np.arange(2), None, None, drafter=_Drafter(), rehearse=False)
    assert eng.calls == 1 and not stats["replayed"]
