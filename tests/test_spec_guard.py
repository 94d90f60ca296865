"""The realized-throughput guard of HistoSpec chunks (``rollout/spec_guard.py``): a chunk runs iff
``(1 + realized acceptance per row-pass) * decode seconds >= verify seconds``, unseen keys and
probes after ``PROBE_EVERY`` declined chunks, then twice as late each time, keys are (row bucket, page-table width)."""

import pytest

from rhyme_jax.rollout.spec_guard import EMA_WEIGHT, MAX_PROBE_EVERY, PROBE_EVERY, SpecGuard


def test_unseen_keys_run_and_the_rule_uses_realized_acceptance():
    g = SpecGuard()
    assert g.allows(64, 96, verify_seconds=3.0, decode_seconds=1.0)  # nothing realized yet
    g.observe(64, 96, accepted=50, row_passes=100)  # 0.5 a row-pass: 1.5 x decode's tokens a pass
    assert g.gain[(64, 96)] == pytest.approx(0.5)
    assert g.allows(64, 96, verify_seconds=1.5, decode_seconds=1.0)  # (1 + 0.5) * 1.0 >= 1.5
    assert not g.allows(64, 96, verify_seconds=1.51, decode_seconds=1.0)
    assert g.allows(64, 24, verify_seconds=9.0, decode_seconds=1.0)  # another width: its own key
    g.observe(64, 96, accepted=300, row_passes=100)  # exponential average of 0.5 and 3.0
    assert g.gain[(64, 96)] == pytest.approx(EMA_WEIGHT * 3.0 + (1 - EMA_WEIGHT) * 0.5)
    g.observe(64, 96, accepted=5, row_passes=0)  # a chunk that ran no row-pass changes nothing
    assert g.gain[(64, 96)] == pytest.approx(EMA_WEIGHT * 3.0 + (1 - EMA_WEIGHT) * 0.5)


def test_declined_keys_are_probed_with_a_doubling_interval():
    """Probes after PROBE_EVERY, then 2x, 4x ... as long as the key does not pay (at most
    MAX_PROBE_EVERY); a chunk that pays resets the interval."""
    g = SpecGuard()
    g.observe(16, 8, accepted=0, row_passes=10)
    runs = [g.allows(16, 8, verify_seconds=2.0, decode_seconds=1.0) for _ in range(7 * PROBE_EVERY)]
    want = []
    for every in (PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY):
        want += [False] * (every - 1) + [True]
    assert runs == want
    assert g.allows(16, 8, verify_seconds=1.0, decode_seconds=1.0)  # pays: interval reset
    runs = [g.allows(16, 8, verify_seconds=2.0, decode_seconds=1.0) for _ in range(PROBE_EVERY)]
    assert runs == [False] * (PROBE_EVERY - 1) + [True]
    g.interval[(16, 8)] = MAX_PROBE_EVERY
    g.declined[(16, 8)] = MAX_PROBE_EVERY - 1
    assert g.allows(16, 8, verify_seconds=2.0, decode_seconds=1.0)
    assert g.interval[(16, 8)] == MAX_PROBE_EVERY
    off = SpecGuard(enabled=False)
    off.observe(16, 8, accepted=0, row_passes=10)
    assert off.allows(16, 8, verify_seconds=2.0, decode_seconds=1.0)


def test_realized_seconds_per_pass_take_precedence_over_the_pass_cost_model():
    """Where the key has realized seconds a pass of both kinds, they decide; the pass-cost model's
    prices fill in for a kind not yet seen at the key."""
    g = SpecGuard()
    g.observe(64, 96, accepted=100, row_passes=100)  # 1 accepted a row-pass: 2 x decode's tokens a pass
    assert g.allows(64, 96, verify_seconds=1.5, decode_seconds=1.0)  # priced by the model: pays
    g.observe_seconds(True, 64, 96, 2.7)  # verify chunks realized 2.7 s a pass
    assert not g.allows(64, 96, verify_seconds=1.5, decode_seconds=1.0)  # 2 x 1.0 < 2.7
    g.observe_seconds(False, 64, 96, 1.4)  # plain chunks realized 1.4 s a pass
    assert g.allows(64, 96, verify_seconds=1.5, decode_seconds=1.0)  # 2 x 1.4 >= 2.7
    g.observe_seconds(False, 64, 96, 1.2)  # exponential average: 0.5 x 1.2 + 0.5 x 1.4 = 1.3
    assert g.plain_seconds[(64, 96)] == pytest.approx(1.3)
    assert not g.allows(64, 96, verify_seconds=1.5, decode_seconds=1.0)  # 2 x 1.3 < 2.7
    assert g.allows(4, 96, verify_seconds=1.5, decode_seconds=1.0)  # another row bucket: unseen
