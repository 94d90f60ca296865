"""The realized-throughput guard of HistoSpec chunks (``rollout/spec_guard.py``): of a ladder of
verify programs it climbs from the bottom, tries a rung once those below it paid, runs the rung
that paid with the most tokens a second (a rung pays iff ``(1 + realized acceptance per row-pass)
* decode seconds >= verify seconds``), probes the first rung that did not pay after
``PROBE_EVERY`` declined chunks, then twice as late each time; keys are (row bucket, page-table
width, verify program), plain decode's seconds are kept per (row bucket, width)."""

import pytest

from rhyme_jax.rollout.spec_guard import EMA_WEIGHT, MAX_PROBE_EVERY, PROBE_EVERY, PROMISE_MARGIN, SpecGuard

ONE = [(96, 3.0)]  # one rung: 96 packed tokens priced at 3 s a pass


def test_unseen_rungs_run_and_the_rule_uses_realized_acceptance():
    g = SpecGuard()
    assert g.choose(64, 96, ONE, decode_seconds=1.0) == 96  # nothing realized yet: the first try
    g.observe(64, 96, 96, accepted=50, row_passes=100)  # 0.5 a row-pass: 1.5 x decode's tokens a pass
    assert g.gain[(64, 96, 96)] == pytest.approx(0.5)
    assert g.choose(64, 96, [(96, 1.5)], decode_seconds=1.0) == 96  # (1 + 0.5) * 1.0 >= 1.5
    assert g.choose(64, 96, [(96, 1.51)], decode_seconds=1.0) is None
    assert g.choose(64, 24, [(96, 9.0)], decode_seconds=1.0) == 96  # another width: its own key
    g.observe(64, 96, 96, accepted=300, row_passes=100)  # exponential average of 0.5 and 3.0
    assert g.gain[(64, 96, 96)] == pytest.approx(EMA_WEIGHT * 3.0 + (1 - EMA_WEIGHT) * 0.5)
    g.observe(64, 96, 96, accepted=5, row_passes=0)  # a chunk that ran no row-pass changes nothing
    assert g.gain[(64, 96, 96)] == pytest.approx(EMA_WEIGHT * 3.0 + (1 - EMA_WEIGHT) * 0.5)


def test_declined_rungs_are_probed_with_a_doubling_interval():
    """Probes after PROBE_EVERY, then 2x, 4x ... as long as the rung does not pay (at most
    MAX_PROBE_EVERY); a chunk that pays resets it; a disabled guard runs the top rung."""
    g = SpecGuard()
    g.observe(16, 8, 96, accepted=0, row_passes=10)
    runs = [g.choose(16, 8, [(96, 2.0)], decode_seconds=1.0) == 96 for _ in range(7 * PROBE_EVERY)]
    want = []
    for every in (PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY):
        want += [False] * (every - 1) + [True]
    assert runs == want
    assert g.choose(16, 8, [(96, 1.0)], decode_seconds=1.0) == 96  # pays: interval reset
    runs = [g.choose(16, 8, [(96, 2.0)], decode_seconds=1.0) == 96 for _ in range(PROBE_EVERY)]
    assert runs == [False] * (PROBE_EVERY - 1) + [True]
    g.interval[(16, 8, 96)] = MAX_PROBE_EVERY
    g.declined[(16, 8, 96)] = MAX_PROBE_EVERY - 1
    assert g.choose(16, 8, [(96, 2.0)], decode_seconds=1.0) == 96
    assert g.interval[(16, 8, 96)] == MAX_PROBE_EVERY
    off = SpecGuard(enabled=False)
    off.observe(16, 8, 96, accepted=0, row_passes=10)
    assert off.choose(16, 8, [(24, 2.0), (96, 2.0)], decode_seconds=1.0) == 96


def test_realized_seconds_per_pass_take_precedence_over_the_pass_cost_model():
    """Where the key has realized seconds a pass of both kinds, they decide; the pass-cost model's
    prices fill in for a kind not yet seen at the key."""
    g = SpecGuard()
    g.observe(64, 96, 96, accepted=100, row_passes=100)  # 1 accepted a row-pass: 2 x decode's tokens a pass
    assert g.choose(64, 96, [(96, 1.5)], decode_seconds=1.0) == 96  # priced by the model: pays
    g.observe_seconds(True, 64, 96, 96, 2.7)  # verify chunks realized 2.7 s a pass
    assert g.choose(64, 96, [(96, 1.5)], decode_seconds=1.0) is None  # 2 x 1.0 < 2.7
    g.observe_seconds(False, 64, 96, 64, 1.4)  # plain chunks realized 1.4 s a pass
    assert g.choose(64, 96, [(96, 1.5)], decode_seconds=1.0) == 96  # 2 x 1.4 >= 2.7
    g.observe_seconds(False, 64, 96, 64, 1.2)  # exponential average: 0.5 x 1.2 + 0.5 x 1.4 = 1.3
    assert g.plain_seconds[(64, 96)] == pytest.approx(1.3)
    assert g.choose(64, 96, [(96, 1.5)], decode_seconds=1.0) is None  # 2 x 1.3 < 2.7
    assert g.choose(4, 96, [(96, 1.5)], decode_seconds=1.0) == 96  # another row bucket: unseen


def test_the_climb_tries_a_rung_once_those_below_paid_and_runs_the_fastest():
    """Rungs (6, 32, 132 packed tokens) of one row bucket and width: the bottom one is tried
    first; the next only once it paid; the one that paid with the most tokens a second runs; a
    rung that did not pay stops the climb (and is probed)."""
    g = SpecGuard()
    rungs = [(6, 1.0), (32, 1.0), (132, 1.0)]
    g.observe_seconds(False, 4, 384, 4, 1.0)
    assert g.choose(4, 384, rungs, 1.0) == 6
    g.observe(4, 384, 6, accepted=2, row_passes=1)  # the bottom rung pays: 3 tokens at 1.2 s
    g.observe_seconds(True, 4, 384, 6, 1.2)
    assert g.choose(4, 384, rungs, 1.0) == 32  # climbs to the next, unseen
    g.observe(4, 384, 32, accepted=9, row_passes=1)  # 10 tokens at 2 s a pass: the fastest
    g.observe_seconds(True, 4, 384, 32, 2.0)
    assert g.choose(4, 384, rungs, 1.0) == 132
    g.observe(4, 384, 132, accepted=10, row_passes=1)  # 11 tokens at 4 s a pass: pays, slower than 32's
    g.observe_seconds(True, 4, 384, 132, 4.0)
    assert g.choose(4, 384, rungs, 1.0) == 32
    assert g.choose(4, 384, rungs[:1], 1.0) == 6  # a chunk that asks for less runs at most its top
    assert g.plain_seconds == {(4, 384): 1.0}
    for _ in range(4):  # 32's acceptance collapses (9 -> 0.56 a row-pass): it stops paying at 2 s a pass
        g.observe(4, 384, 32, accepted=0, row_passes=1)
    assert g.gain[(4, 384, 32)] == pytest.approx(9 / 16)
    assert g.choose(4, 384, rungs, 1.0) == 6 and g.declined[(4, 384, 32)] == 1  # the climb stops at 32


def test_first_tries_and_probes_are_trials_and_paying_choices_are_not():
    """``trial`` marks a key's first try and a probe (the chunk then runs at most ``TRIAL_PASSES``
    passes); a rung chosen because it paid, a plain chunk and a disabled guard's choice are not."""
    g = SpecGuard()
    assert g.choose(64, 96, ONE, decode_seconds=1.0) == 96 and g.trial  # first try
    g.observe(64, 96, 96, accepted=300, row_passes=100)  # 3 a row-pass: pays at 3 s a pass
    assert g.choose(64, 96, ONE, decode_seconds=1.0) == 96 and not g.trial
    g.observe(64, 96, 96, accepted=0, row_passes=100)  # EMA 1.5: (1 + 1.5) * 1.0 < 3.0
    got = [g.choose(64, 96, ONE, decode_seconds=1.0) for _ in range(PROBE_EVERY)]
    assert got[:-1] == [None] * (PROBE_EVERY - 1) and got[-1] == 96 and g.trial  # the probe
    assert g.choose(64, 96, ONE, decode_seconds=1.0) is None and not g.trial
    off = SpecGuard(enabled=False)
    assert off.choose(64, 96, ONE, decode_seconds=1.0) == 96 and not off.trial


def test_a_rung_whose_drafts_land_lets_the_climb_past_it_even_above_the_chunks_ask():
    """A rung whose drafts were accepted at a rate ``a`` at which the next rung's draft room ``k``
    would pay (``(1 + a (1 - a^k) / (1 - a)) * decode >= verify``) promises it: a rung that does
    not pay but promises does not stop the climb, and the next rung gets its first try, also the
    rung just above the chunk's ask (``above``), which is otherwise never climbed to. A promised
    rung that was tried and did not pay is tried again once the rate below rose by
    ``PROMISE_MARGIN`` since it last promised it."""
    g = SpecGuard()
    g.observe_seconds(False, 4, 384, 4, 1.0)
    g.observe(4, 384, 6, accepted=1, row_passes=3, drafted=3)  # a third of the 1-token drafts land
    g.observe_seconds(True, 4, 384, 6, 2.5)  # (1 + 1/3) * 1.0 < 2.5: does not pay
    above = (32, 2.0, 9)  # 9 draft tokens a row at 2 s a pass
    assert g.choose(4, 384, [(6, 2.5, 1)], 1.0, above) is None  # 1/3 promises 0.5 a pass: 1.5 < 2.0
    assert g.declined[(4, 384, 6)] == 1
    g.observe(4, 384, 6, accepted=3, row_passes=3, drafted=3)  # now every draft lands: rate 2/3
    assert g.rate[(4, 384, 6)] == pytest.approx(EMA_WEIGHT * 1.0 + (1 - EMA_WEIGHT) / 3)
    assert g.gain[(4, 384, 6)] == pytest.approx(2 / 3)  # (1 + 2/3) * 1.0 < 2.5: still does not pay
    # 2/3 promises (2/3)(1 - (2/3)^9) / (1/3) = 1.95 a pass at 32: 2.95 * 1.0 >= 2.0
    assert g.choose(4, 384, [(6, 2.5, 1)], 1.0) is None  # without a rung above, the climb stops
    assert g.choose(4, 384, [(6, 2.5, 1)], 1.0, (32, 4.0, 9)) is None  # a dearer rung above: no promise
    assert g.choose(4, 384, [(6, 2.5, 1)], 1.0, above) == 32 and g.trial
    g.observe(4, 384, 32, accepted=0, row_passes=3, drafted=27)  # the rows were not repeating yet
    g.observe_seconds(True, 4, 384, 32, 2.0)
    assert g.choose(4, 384, [(6, 2.5, 1)], 1.0, above) is None  # 32 was judged: accepts nothing
    assert g.declined[(4, 384, 32)] == 1
    g.observe(4, 384, 6, accepted=3, row_passes=3, drafted=3)  # the rate below rises to 5/6 (> 2/3 + 0.1)
    assert g.rate[(4, 384, 6)] >= g.promised[(4, 384, 32)] + PROMISE_MARGIN
    assert g.choose(4, 384, [(6, 2.5, 1)], 1.0, above) == 32 and g.trial  # tried again
    g.observe(4, 384, 32, accepted=54, row_passes=3, drafted=54)  # 9 a row-pass in each of 2 chunks
    assert g.choose(4, 384, [(6, 2.5, 1)], 1.0, above) == 32 and not g.trial  # EMA 9: pays at 2 s
    assert g.choose(4, 384, [(6, 2.5, 1)], 1.0, above) == 32 and not g.trial  # no new promise: no trial
    low = SpecGuard()  # a top rung that pays on drafts that rarely land: the rung above is not tried
    low.observe(4, 384, 6, accepted=1, row_passes=3, drafted=3)
    low.observe_seconds(True, 4, 384, 6, 1.2)  # (1 + 1/3) * 1.0 >= 1.2
    assert low.choose(4, 384, [(6, 1.2, 1)], 1.0, above) == 6 and (4, 384, 32) not in low.gain
    low.observe(4, 384, 6, accepted=3, row_passes=3, drafted=3)  # they land: it promises the rung above
    assert low.choose(4, 384, [(6, 1.2, 1)], 1.0, above) == 32 and low.trial


def test_declined_chunks_graded_on_their_tokens_try_a_rung_before_the_probe():
    """``observe_shadow`` keeps per (rows, width) the per-token rate ``accepted / (accepted +
    misses)`` of the drafts graded on plain chunks' tokens. A climb that stops at a rung in
    back-off tries, at once, the first rung from there up whose drafts would pay at that rate (a
    trial), once per rise of ``PROMISE_MARGIN``; a rate that fell ``PROMISE_MARGIN`` below re-arms it."""
    g = SpecGuard()
    g.observe_seconds(False, 4, 384, 4, 1.0)
    g.observe(4, 384, 6, accepted=0, row_passes=3, drafted=3)  # the bottom rung's drafts missed
    g.observe_seconds(True, 4, 384, 6, 2.5)
    rungs, above = [(6, 2.5, 1)], (32, 2.0, 9)
    assert g.choose(4, 384, rungs, 1.0, above) is None and g.declined[(4, 384, 6)] == 1
    g.observe_shadow(4, 384, accepted=0, failed=0)  # nothing graded: no rate
    assert (4, 384) not in g.shadow
    g.observe_shadow(4, 24, accepted=30, failed=2)  # another width: its own rate
    assert g.choose(4, 384, rungs, 1.0, above) is None
    g.observe_shadow(4, 384, accepted=30, failed=2)  # a = 30/32: 1.94 x 1.0 < 2.5 at room 1, 7.6 x 1.0 >= 2.0 at 9
    assert g.shadow[(4, 384)] == pytest.approx(30 / 32)
    assert g.choose(4, 384, rungs, 1.0, above) == 32 and g.trial  # the rung the rate promises, before any probe
    assert g.declined[(4, 384, 6)] == 2  # the probe's count goes on
    g.observe(4, 384, 32, accepted=0, row_passes=3, drafted=27)  # it did not land after all
    g.observe_seconds(True, 4, 384, 32, 2.0)
    assert g.choose(4, 384, rungs, 1.0, above) is None and not g.trial  # the same rate: no second try
    g.observe_shadow(4, 384, accepted=30, failed=2)  # the rate holds: still no second try
    assert g.choose(4, 384, rungs, 1.0, above) is None
    for _ in range(2):
        g.observe_shadow(4, 384, accepted=0, failed=10)  # it falls to 0.23: the record is dropped
    assert g.shadow[(4, 384)] < 30 / 32 - PROMISE_MARGIN and not g.shadow_promised
    assert g.choose(4, 384, rungs, 1.0, above) is None  # 0.23 promises nothing
    for _ in range(4):
        g.observe_shadow(4, 384, accepted=10, failed=0)  # rises again to 0.95
    assert g.choose(4, 384, rungs, 1.0, above) == 32 and g.trial
    cheap = SpecGuard()  # the bottom rung itself pays at the rate: it is the one tried
    cheap.observe_seconds(False, 4, 384, 4, 1.0)
    cheap.observe(4, 384, 6, accepted=0, row_passes=3, drafted=3)
    cheap.observe_seconds(True, 4, 384, 6, 1.5)
    cheap.observe_shadow(4, 384, accepted=9, failed=1)  # 1.9 x 1.0 >= 1.5
    assert cheap.choose(4, 384, rungs, 1.0, above) == 6 and cheap.trial
