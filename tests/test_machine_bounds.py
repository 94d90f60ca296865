"""``rhyme_lab.bench.machine_bounds``: the report's arithmetic (no timing is asserted)."""

from __future__ import annotations

import pytest

from rhyme_lab.bench.machine_bounds import machine_bounds, matmul_rate, weight_read_ms


def test_weight_read_bound_is_bytes_over_bandwidth():
    assert weight_read_ms(540_000_000, 12.0) == pytest.approx(45.0, rel=1e-12)  # 0.54 GB at 12 GB/s


def test_report_rates_follow_from_their_own_seconds():
    rep = machine_bounds({"m": 4_000_000}, [(8, 16, 4)], bandwidth_bytes=1 << 20, repeats=1)
    bw = rep["read_bandwidth"]
    assert bw["bytes"] == 1 << 20 and bw["gb_per_s"] == pytest.approx(bw["bytes"] / bw["seconds"] / 1e9)
    mm = rep["matmul"][0]
    assert mm["shape"] == [8, 16, 4] and mm["flops"] == 2 * 8 * 16 * 4
    for engine in ("xla", "torch"):
        if "error" not in mm[engine]:
            assert mm[engine]["gflop_per_s"] == pytest.approx(mm["flops"] / mm[engine]["seconds"] / 1e9)
    assert rep["weight_read_ms"]["m"] == pytest.approx(weight_read_ms(4_000_000, bw["gb_per_s"]))


def test_torch_is_optional():
    assert set(matmul_rate(2, 2, 2, repeats=1, engines=("xla",))) == {"shape", "flops", "xla"}
