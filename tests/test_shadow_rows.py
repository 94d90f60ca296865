"""Shadow rows (``rollout/shadow.py``): a row's runner-up draft verified in the same pass.

The engine must emit exactly plain decoding's sampled tokens whichever candidate wins, take
fewer passes when the runner-up is the right one, and keep the page pool consistent (the
allocator's invariants are checked after every pass)."""

import jax
import numpy as np
import pytest

from rhyme_jax.rollout import shadow
from rhyme_jax.rollout.engine import SamplingParams
from rhyme_jax.rollout.page_allocator import PageAllocationError, PageAllocator
from test_histospec_engine import HistoryDrafter
from test_rollout_engine import MAX_NEW, _engine, _model, _prompts


class RunnerUpDrafter(HistoryDrafter):
    """Best candidate: the history's continuation with every token replaced (never accepted,
    estimate ``best_est``); runner-up (``alternates``): the true continuation (``alt_est``), or
    a corrupted one with ``alt_corrupt``."""

    def __init__(self, history, best_est=0.6, alt_est=0.95, alt_corrupt=0.0, runner_up=True):
        super().__init__(history, window=8)
        self.best_est, self.alt_est, self.alt_corrupt = best_est, alt_est, alt_corrupt
        self.runner_up = runner_up
        self.estimates = self.alternates = self.priorities = None
        self.advanced = []

    def draft(self, reqs, tails, budgets):
        right, lens = super().draft(reqs, tails, budgets)
        wrong = (right + 1 + self.rng.integers(0, self.vocab - 1, right.shape)) % self.vocab
        self.estimates = np.full(right.shape, self.best_est, np.float32)
        if self.runner_up:
            alt = right.copy()
            bad = self.rng.random(alt.shape) < self.alt_corrupt
            alt[bad] = self.rng.integers(0, self.vocab, int(bad.sum()))
            self.alternates = (alt, lens.copy(), np.full(right.shape, self.alt_est, np.float32))
        return wrong.astype(np.int32), lens

    def observe(self, reqs, drafted, accepted, advanced=None):
        super().observe(reqs, drafted, accepted)
        self.advanced.append(accepted if advanced is None else advanced)


def _rollouts(drafter_kw):
    prompts = _prompts(7, (4, 10, 6, 8))
    eng = _engine(max_slots=8)
    sp = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=MAX_NEW)
    key = jax.random.key(11)
    plain = eng.generate(_model()[1], prompts, sp, key)
    history = [np.concatenate([p, t]).astype(np.int32) for p, t in zip(prompts, plain.tokens)]
    runs = {}
    for name, kw in (("with", drafter_kw), ("without", dict(drafter_kw, runner_up=False))):
        drafter = RunnerUpDrafter(history, **kw)
        runs[name] = eng.generate(_model()[1], prompts, sp, key, drafter=drafter), drafter
    return plain, runs


@pytest.mark.parametrize("alt_corrupt", [0.0, 0.5])
def test_shadow_rows_emit_plain_tokens_and_win_with_the_right_runner_up(alt_corrupt):
    plain, runs = _rollouts(dict(alt_corrupt=alt_corrupt))
    res, drafter = runs["with"]
    for r, _ in runs.values():
        for a, b, la, lb in zip(plain.tokens, r.tokens, plain.logprobs, r.logprobs):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_allclose(la, lb, rtol=1e-4, atol=1e-5)
    s = res.stats
    assert s["shadow_rows"] > 0 and s["shadow_wins"] > 0
    assert runs["without"][0].stats["shadow_rows"] == 0
    if alt_corrupt == 0.0:  # the runner-up is right: it wins where the row's own draft fails
        assert s["decode_steps"] < runs["without"][0].stats["decode_steps"]
        assert max(int(np.max(a, initial=0)) for a in drafter.advanced) > 0
    assert s["accepted_tokens"] == sum(int(np.sum(a)) for a in drafter.advanced)


def test_allocator_lends_pages_to_a_shadow_and_a_slot_adopts_them():
    alloc = PageAllocator(num_pages=10, page_size=4, max_slots=2, pages_per_seq=4)
    alloc.ensure(0, 7)  # pages 1, 2
    taken = alloc.take(2)
    alloc.check()
    assert alloc.num_free == 5 and set(taken.tolist()).isdisjoint(alloc.page_table[0, :2].tolist())
    alloc.adopt(0, 1, taken)
    alloc.check()
    assert alloc.page_table[0, :3].tolist() == [1, *taken.tolist()] and alloc.num_held[0] == 3
    assert alloc.num_free == 6  # page 2 went back
    back = alloc.take(1)
    alloc.give_back(back)
    alloc.check()
    with pytest.raises(PageAllocationError, match="not taken"):
        alloc.give_back(back)
    with pytest.raises(PageAllocationError, match="from take"):
        alloc.adopt(1, 0, np.array([1], np.int32))
    with pytest.raises(PageAllocationError, match="only 6 free"):
        alloc.take(7)


def test_gain_counts_the_runner_up_past_where_it_leaves_the_sent_draft():
    sent = np.array([[5, 6, 7, 0], [1, 2, 3, 4]])
    alt = np.array([[5, 9, 9], [7, 7, 7]])
    gain, curve = shadow.gains(sent, np.array([3, 4]), alt, np.array([3, 2]), np.full((2, 3), 0.5, np.float32))
    np.testing.assert_allclose(curve, [[0.5, 0.25, 0.125], [0.5, 0.25, 0.0]])
    np.testing.assert_allclose(gain, [0.25 + 0.125, 0.75])  # row 0 shares its first token


def test_select_takes_spare_tokens_then_displaces_only_cheaper_draft_tails():
    sent_value = np.array([[0.9, 0.5, 0.1], [0.9, 0.8, 0.7], [0.0, 0.0, 0.0]])
    sent_lens = np.array([3, 3, 0])
    # row 2's shadow (4 tokens, gain 1.0) with 1 spare token needs the 3 cheapest sent tokens of
    # the other rows (0.1, 0.5, 0.7: 1.3 >= 1.0): not taken
    rows, lens = shadow.select(4, 1, np.array([0, 0, 4]), np.array([0.0, 0.0, 1.0]), sent_value, sent_lens)
    assert rows.size == 0 and lens.tolist() == [3, 3, 0]
    rows, lens = shadow.select(4, 2, np.array([0, 0, 4]), np.array([0.0, 0.0, 1.0]), sent_value, sent_lens)
    assert rows.tolist() == [2] and lens.tolist() == [1, 3, 0]  # 0.1 + 0.5 < 1.0
    rows, _ = shadow.select(0, 10, np.array([0, 0, 4]), np.array([0.0, 0.0, 1.0]), sent_value, sent_lens)
    assert rows.size == 0  # no free row
