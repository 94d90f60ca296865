"""The library behind the thin benchmark entry points (issue 33): the suffix-tree peer's replay
(``measure.peer_replay``, ``python -m benchmarks.replay_peer``) on a stand-in peer, the paired
plain/HistoSpec report (``measure.paired_report``, ``benchmarks.rollout`` / ``spec_sweep``), the
drafting-time walk (``measure.draft_cost``, ``benchmarks.draft_time``) and the timing harness."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from rhyme_lab.measure import draft_cost, paired_report, pass_overhead, peer_replay, timing
from rhyme_lab.measure.text_replay import ReplayCase


class _Tree:
    """Stand-in for arctic-inference's ``SuffixTree``: drafts the continuation after the last
    earlier occurrence of the context's last token in its sequences (a path draft)."""

    def __init__(self, depth: int):
        self.seqs: dict[int, list[int]] = {}

    def extend_ndarray(self, seq: int, tokens: np.ndarray) -> None:
        self.seqs.setdefault(seq, []).extend(int(t) for t in tokens)

    def speculate_ndarray(self, context, limit, factor, offset, min_prob, tree):
        best: list[int] = []
        for s in self.seqs.values():
            for j in range(len(s) - 1):
                if s[j] == context[-1] and len(s[j + 1: j + 1 + limit]) > len(best):
                    best = s[j + 1: j + 1 + limit]
        return SimpleNamespace(token_ids=best, parents=list(range(-1, len(best) - 1)), score=float(len(best)))


def test_peer_replay_counts_every_target_token_once():
    peer = SimpleNamespace(SuffixTree=_Tree)
    a = np.arange(10, 30, dtype=np.int32)
    cases = [ReplayCase(np.array([1, 2], np.int32), [a], np.ones(1), a.copy()),  # the history repeats
             ReplayCase(np.array([3], np.int32), [], np.zeros(0), np.arange(40, 50, dtype=np.int32))]
    out = peer_replay.replay(peer, cases, peer_replay.PeerOptions())
    assert out["target_tokens"] == 30
    assert out["sequence_passes"] + out["accepted_tokens"] == 30  # each pass: accepted + 1
    # the first pass has no match for the prompt's last token; then a's other 19 tokens in one pass
    # (its draft cut to the tokens left - 1); nothing to copy for the second target
    assert out["acceptance"] == 1.0 and out["accepted_tokens"] == 18
    assert out["sequence_passes"] == 2 + 10


def test_load_peer_names_the_build_script(tmp_path):
    with pytest.raises(peer_replay.PeerUnavailable, match="build_suffix_peer.sh"):
        peer_replay.load_peer(tmp_path)


def _stats(tokens, seconds, passes, drafted=0, accepted=0, drafting=0.0):
    return dict(generated_tokens=tokens, seconds=seconds, forward_passes=passes, sequence_steps=passes * 2,
                drafted_tokens=drafted, accepted_tokens=accepted, drafting_seconds=drafting, compiles=0)


def test_paired_ratios_and_report(tmp_path, capsys):
    rows = [{"epoch": e, "plain": _stats(100, 1.0, 100), "spec": _stats(100, 0.5, 40, 80, 60, 0.05)}
            for e in (1, 3)]
    r = paired_report.paired_ratios(rows)
    assert r["speedup"] == pytest.approx(2.0) and r["passes_ratio"] == pytest.approx(2.5)
    assert r["acceptance"] == pytest.approx(0.75) and r["spec_drafted_per_token"] == pytest.approx(0.8)
    assert r["drafting_share"] == pytest.approx(0.1) and r["speedup_without_drafting"] == pytest.approx(200 / 90)
    assert r["spec_tokens_per_seq_forward"] == pytest.approx(100 / 80)
    paired_report.write_report(rows, tmp_path, final=True, meta={"backend": "cpu"})
    body = json.loads((tmp_path / "rollout_benchmark.json").read_text())
    assert [e["epoch"] for e in body["epochs"]] == [1, 3] and body["epoch3_on"]["speedup"] == pytest.approx(2.0)
    assert "2.00x rollout tokens/s" in capsys.readouterr().out


def test_draft_times_walk_the_workload():
    r = draft_cost.draft_times("goodput", 2, 2, 0, self_lookup=True)
    assert r["policy"] == "goodput+self_lookup" and r["steps"] > 1
    assert 0 < r["accepted_share"] < 1 and r["draft_us_median"] > 0


def test_timing_harness_counts_calls():
    calls = []
    assert len(timing.seconds_of(lambda: calls.append(1), 3, warmup=2)) == 3 and len(calls) == 5
    assert timing.median_seconds(lambda: None, 1) >= 0
    with pytest.raises(ValueError):
        timing.seconds_of(lambda: None, 0)


def test_pass_overhead_figures_split_host_and_device_time():
    """2 s of which 1.5 s blocked on the device, 100 passes, 1000 tokens: host 5 ms/pass, device
    15 ms/pass, 500 tokens/s against a bound of 1000 / 1.5 s."""
    stats = dict(decode_steps=100, decode_dispatches=10, device_wait_seconds=1.5, seconds=2.0, tokens_per_s=500.0,
                 generated_tokens=1000, drafting_seconds=0.2)
    f = pass_overhead.figures(stats)
    assert f["host_ms_per_pass"] == pytest.approx(5.0) and f["device_ms_per_pass"] == pytest.approx(15.0)
    assert f["bound_tokens_per_s"] == pytest.approx(1000 / 1.5) and f["of_bound"] == pytest.approx(0.75)
    assert f["drafting_share"] == pytest.approx(0.1) and f["decode_dispatches"] == 10
    text = pass_overhead.table({"model": "demo"}, {"engines": {1: f}, "same_tokens": True})
    assert "| 1 | 5.000 | 15.000 | 500 | 667 | 75.0% | 10.0% | 100 | 10 |" in text


def test_tail_attention_sweep_times_each_implementation_against_its_decode():
    from rhyme_lab.bench import tail_attention as ta

    cases = (ta.TailCase(4, 8, 1, 100, 1), ta.TailCase(4, 8, 1, 100, 3))
    rows = ta.sweep(cases, ("reference", "live_pages"), log=None, repeats=1, layers=2, pool_pages=50)
    assert [r["q_len"] for r in rows] == [1, 3]
    assert all(r["ms"][i] > 0 for r in rows for i in ("reference", "live_pages"))
    q, pool, kv, table, *_ = ta.case_inputs(np.random.default_rng(0), cases[0], layers=1, kv_heads=1, heads=1,
                                            head_dim=4, page_size=16, pool_pages=50)
    assert pool.shape[2] == 50 and len(set(np.asarray(table).ravel())) == 32 and 0 not in np.asarray(table)
    assert set(ta.MODELS) == {"longtail", "smollm2"} and all(len(m[2]) > 0 for m in ta.MODELS.values())
    assert rows[0]["x_decode"] == {"reference": 1.0, "live_pages": 1.0}
    assert rows[1]["x_decode"]["live_pages"] == pytest.approx(rows[1]["ms"]["live_pages"] / rows[0]["ms"]["live_pages"])
    assert "| 4 | 8 | 1 | 100 | 3 |" in ta.table(rows)
    with pytest.raises(ValueError, match="context"):
        ta.case_inputs(np.random.default_rng(0), ta.TailCase(1, 2, 1, 100, 1), layers=1, kv_heads=1, heads=1,
                       head_dim=4, page_size=16)
