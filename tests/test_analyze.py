"""``python -m rhyme_lab analyze``: O5/O6 of a fake run against a brute-force recomputation."""

import json

import numpy as np
import pytest

from rhyme_lab.cli.main import main
from rhyme_lab.analyze import MARKER, analyze, length_percentiles, write_analysis
from rhyme_jax.spec.suffix_index import SuffixIndex
from rhyme_jax.io.rollout_log import save_rollouts

SCHEDULE = [[0, 1], [2, 3], [0, 1, 2], [3, 0], [0, 1, 2, 3], [1, 2]]  # prompt ids per step
N = 3  # samples per prompt


def _fake_run(run_dir, seed=0, vocab=12):
    """Responses of each prompt repeat a base with small edits (substitutions, a cut, an insertion);
    lengths drift so some length ranks move."""
    rng = np.random.default_rng(seed)
    base = {p: rng.integers(0, vocab, rng.integers(15, 40)) for p in range(4)}
    saved = []
    for step, pids in enumerate(SCHEDULE):
        ids, resp = [], []
        for p in pids:
            if rng.random() < 0.4:  # the prompt's answers grow or shrink between epochs
                base[p] = np.concatenate([base[p], rng.integers(0, vocab, rng.integers(0, 25))])[
                    : rng.integers(10, 60)]
            for _ in range(N):
                r = base[p].copy()
                r[rng.integers(0, r.size, 2)] = rng.integers(0, vocab, 2)
                k = rng.integers(0, r.size)
                r = np.concatenate([r[:k], rng.integers(0, vocab, rng.integers(0, 3)), r[k:]])
                ids.append(p)
                resp.append(r[: rng.integers(r.size - 3, r.size + 1)])
        rewards = rng.choice([0.0, 0.5, 1.0], len(ids))
        save_rollouts(run_dir, step, np.array(ids), resp, rewards)
        saved.append((np.array(ids), resp, rewards))
    return saved


def _aimd(w, drafted, accepted):
    if drafted == 0:
        return w
    return min(w + 2, 32) if accepted == drafted else 2


def _brute(saved, shift=0.1):
    seen, prev, epochs = {}, {}, {}
    for ids, resp, rewards in saved:
        pids = list(dict.fromkeys(ids.tolist()))
        means = {p: np.mean([resp[i].size for i in np.flatnonzero(ids == p)]) for p in pids}
        pct = {}
        for p in pids:  # O(P^2) rank: smaller means + half the other equal ones, over P - 1
            below = sum(means[q] < means[p] for q in pids)
            equal = sum(means[q] == means[p] for q in pids if q != p)
            pct[p] = (below + 0.5 * equal) / (len(pids) - 1) if len(pids) > 1 else 0.5
        for p in pids:
            seen[p] = seen.get(p, 0) + 1
            if p not in prev:
                continue
            e = epochs.setdefault(seen[p], {"tokens": 0, "predicted": 0, "prompts": 0, "moved": 0})
            e["prompts"] += 1
            e["moved"] += abs(pct[p] - prev[p][2]) > shift
            ix = SuffixIndex.build(MARKER, prev[p][0], prev[p][1])
            for i in np.flatnonzero(ids == p):
                r = resp[i].tolist()
                pos, w = 0, 2
                while pos < len(r):
                    ctx = MARKER.tolist() + r[:pos]
                    d = ix.draft(np.array(ctx[-7:]), min(w, len(r) - pos), branch="reward",
                                 min_token_prob=0.1).tolist()
                    a = 0
                    while a < len(d) and d[a] == r[pos + a]:
                        a += 1
                    e["predicted"] += a
                    w = _aimd(w, len(d), a)
                    pos += a + 1
                e["tokens"] += len(r)
        for p in pids:
            rows = np.flatnonzero(ids == p)
            prev[p] = ([resp[i] for i in rows], rewards[rows], pct[p])
    return epochs


def test_percentiles_with_ties():
    m = np.array([3.0, 1.0, 3.0, 2.0, 5.0, 3.0])
    want = [(np.sum(m < x) + 0.5 * (np.sum(m == x) - 1)) / 5 for x in m]
    assert length_percentiles(m).tolist() == pytest.approx(want)
    assert length_percentiles(np.array([4.0])).tolist() == [0.5]


@pytest.mark.parametrize("seed", [0, 1])
def test_o5_o6_match_brute_force(tmp_path, seed):
    saved = _fake_run(tmp_path, seed)
    res = analyze(tmp_path)
    want = _brute(saved)
    assert [e["epoch"] for e in res["epochs"]] == sorted(want)
    for e in res["epochs"]:
        w = want[e["epoch"]]
        assert (e["tokens"], e["predicted"], e["prompts"], e["rank_moved"]) == (
            w["tokens"], w["predicted"], w["prompts"], w["moved"])
        assert e["rhyme"] == w["predicted"] / w["tokens"]
        assert e["rank_shift_share"] == w["moved"] / w["prompts"]
        assert e["responses"] == N * e["prompts"]
    assert res["overall"]["predicted"] == sum(w["predicted"] for w in want.values())
    assert 0.3 < res["overall"]["rhyme"] < 1.0  # rhyming fake responses: most tokens predicted
    assert sum(w["moved"] for w in want.values()) > 0  # O6 is exercised


def test_outputs_and_cli(tmp_path, capsys):
    _fake_run(tmp_path, 2)
    assert main(["analyze", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    res = analyze(tmp_path)
    assert "| all |" in out and f"{res['overall']['rhyme']:.1%}" in out
    data = json.loads((tmp_path / "analysis.json").read_text())
    assert data["overall"] == res["overall"]
    assert [e["predicted"] for e in data["epochs"]] == [e["predicted"] for e in res["epochs"]]
    assert "| epoch |" in (tmp_path / "analysis.md").read_text()
    assert (tmp_path / "analysis.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert write_analysis(tmp_path, res)["png"] == tmp_path / "analysis.png"


def test_cli_user_errors_are_one_line(tmp_path, capsys):
    assert main(["analyze", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no saved rollouts" in err
    save_rollouts(tmp_path, 0, np.array([0, 1]), [np.array([1, 2]), np.array([3])], np.zeros(2))
    assert main(["analyze", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "rolled out twice" in err
