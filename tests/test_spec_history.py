"""HistoSpec history store: grouping, depth, atomic update, save/load round trip, crash safety."""

import numpy as np
import pytest

from rhyme_jax.spec import history as H
from rhyme_jax.spec.history import HistoryError, HistoryStore


def _step(rng, pids, n=3, vocab=50):
    """One GRPO step's samples: n per prompt id, interleaved, random lengths (some empty)."""
    ids = np.array([p for _ in range(n) for p in pids], dtype=np.int64)
    prompts = [np.arange(p, p + 4 + p % 3) for p in ids]
    responses = [rng.integers(0, vocab, rng.integers(0, 9)) for _ in ids]
    rewards = rng.choice([0.0, 0.5, 1.0], ids.size).astype(np.float32)
    return ids, prompts, responses, rewards


def _snapshot(store):
    """Everything the store holds, as plain Python values."""
    out = {}
    for pid in store.prompt_ids():
        e = store.entry(pid)
        out[pid] = (e.prompt.tolist(), [(ro.step, [r.tolist() for r in ro.responses], ro.rewards.tolist(),
                                         ro.lengths.tolist()) for ro in e.rollouts])
    return out, store.version, store.depth


def test_update_groups_samples_by_prompt():
    rng = np.random.default_rng(0)
    store = HistoryStore(depth=1)
    ids, prompts, responses, rewards = _step(rng, [7, 3, 9])
    assert store.update(5, ids, prompts, responses, rewards) == [7, 3, 9]
    assert len(store) == 3 and 3 in store and 4 not in store and store.version == 1
    for pid in (7, 3, 9):
        rows = np.flatnonzero(ids == pid)
        e = store.entry(pid)
        assert e.prompt.dtype == np.int32 and e.prompt.tolist() == prompts[rows[0]].tolist()
        (ro,) = e.rollouts
        assert ro.step == 5
        assert [r.tolist() for r in ro.responses] == [responses[i].tolist() for i in rows]
        assert ro.rewards.tolist() == rewards[rows].tolist()
        assert store.lengths(pid).tolist() == [responses[i].size for i in rows]
        assert not e.prompt.flags.writeable and not ro.responses[0].flags.writeable
    assert store.entry(4) is None and store.lengths(4) is None
    with pytest.raises(KeyError, match="prompt_id 4"):
        store.responses(4)


def test_depth_keeps_the_last_rollouts_oldest_first():
    rng = np.random.default_rng(1)
    store = HistoryStore(depth=2)
    steps = [_step(rng, [1, 2]), _step(rng, [1]), _step(rng, [1, 2])]
    for s, (ids, prompts, responses, rewards) in enumerate(steps):
        store.update(s, ids, prompts, responses, rewards)
    assert [ro.step for ro in store.entry(1).rollouts] == [1, 2]  # step 0 dropped
    assert [ro.step for ro in store.entry(2).rollouts] == [0, 2]
    resp, rw = store.responses(1)
    ids1, _, r1, w1 = steps[1]
    ids2, _, r2, w2 = steps[2]
    want = [r1[i].tolist() for i in np.flatnonzero(ids1 == 1)] + [r2[i].tolist() for i in np.flatnonzero(ids2 == 1)]
    assert [r.tolist() for r in resp] == want
    assert rw.tolist() == w1[ids1 == 1].tolist() + w2[ids2 == 1].tolist()
    assert store.lengths(1).tolist() == [r2[i].size for i in np.flatnonzero(ids2 == 1)]
    assert store.version == 3


def test_save_load_round_trip(tmp_path):
    rng = np.random.default_rng(2)
    store = HistoryStore(depth=3)
    for s in range(4):
        store.update(10 + s, *_step(rng, [5, 0, 11] if s % 2 else [0, 2]))
    path = store.save(tmp_path / "history.npz")
    loaded = HistoryStore.load(path)
    assert _snapshot(loaded) == _snapshot(store)
    for pid in store.prompt_ids():
        for a, b in zip(store.entry(pid).rollouts, loaded.entry(pid).rollouts):
            assert a.rewards.dtype == b.rewards.dtype == np.float32
            assert a.lengths.dtype == b.lengths.dtype == np.int32
            assert all(x.dtype == np.int32 for x in b.responses)
    assert _snapshot(HistoryStore.from_bytes(store.to_bytes())) == _snapshot(store)
    assert store.to_bytes() == path.read_bytes()
    empty = HistoryStore.load(HistoryStore(depth=2).save(tmp_path / "empty.npz"))
    assert len(empty) == 0 and empty.depth == 2


def test_exception_mid_update_leaves_store_unchanged(monkeypatch):
    rng = np.random.default_rng(3)
    store = HistoryStore(depth=2)
    store.update(0, *_step(rng, [1, 2, 3]))
    before = _snapshot(store)
    calls = []
    real = H._make_rollout

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated crash")
        return real(*args)

    monkeypatch.setattr(H, "_make_rollout", failing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        store.update(1, *_step(rng, [1, 2, 3]))
    assert len(calls) == 2  # prompt 1's new rollout was built before the crash
    assert _snapshot(store) == before


def test_bad_update_names_the_argument():
    store = HistoryStore()
    ids = np.array([0, 0])
    ok = [np.array([1, 2]), np.array([1, 2])]
    with pytest.raises(HistoryError, match="rewards"):
        store.update(0, ids, ok, ok, np.zeros(3))
    with pytest.raises(HistoryError, match="responses"):
        store.update(0, ids, ok, ok[:1], np.zeros(2))
    with pytest.raises(HistoryError, match=r"responses\[1\]"):
        store.update(0, ids, ok, [np.array([1]), np.array([-3])], np.zeros(2))
    with pytest.raises(HistoryError, match=r"prompts\[1\]"):
        store.update(0, ids, [np.array([1]), np.array([2])], ok, np.zeros(2))
    with pytest.raises(HistoryError, match="depth"):
        HistoryStore(depth=0)
    assert len(store) == 0 and store.version == 0


def test_crash_mid_save_keeps_the_old_file(tmp_path, monkeypatch):
    rng = np.random.default_rng(4)
    store = HistoryStore()
    store.update(0, *_step(rng, [1, 2]))
    path = store.save(tmp_path / "h.npz")
    old = _snapshot(store)
    store.update(1, *_step(rng, [1, 3]))

    def partial(fh, arrays):
        fh.write(b"PK\x03\x04 half of a zip file")
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(H, "_write_npz", partial)
    with pytest.raises(OSError, match="simulated"):
        store.save(path)
    assert _snapshot(HistoryStore.load(path)) == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.npz"]  # no temp file left


def test_corrupt_or_inconsistent_file_raises_history_error(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip file at all")
    with pytest.raises(HistoryError, match="bad.npz"):
        HistoryStore.load(bad)
    with pytest.raises(HistoryError, match="missing.npz"):
        HistoryStore.load(tmp_path / "missing.npz")

    rng = np.random.default_rng(5)
    store = HistoryStore()
    store.update(0, *_step(rng, [1, 2]))
    good = store.save(tmp_path / "good.npz")
    good_bytes = good.read_bytes()
    truncated = tmp_path / "trunc.npz"
    truncated.write_bytes(good_bytes[: len(good_bytes) // 2])
    with pytest.raises(HistoryError, match="trunc.npz"):
        HistoryStore.load(truncated)

    arrays = dict(np.load(good))
    for field, change in [("lengths", lambda a: a + 1), ("token_offsets", lambda a: a[:-1]),
                          ("rollout_offsets", lambda a: a * 0), ("tokens", lambda a: a.astype(np.float32))]:
        broken = dict(arrays, **{field: change(arrays[field])})
        p = tmp_path / f"broken_{field}.npz"
        np.savez(p, **broken)
        with pytest.raises(HistoryError, match=f"broken_{field}.npz: field {field}"):
            HistoryStore.load(p)
    with pytest.raises(HistoryError, match="checkpoint step 3"):
        HistoryStore.from_bytes(good_bytes[:100], source="checkpoint step 3")
    missing = {k: v for k, v in arrays.items() if k != "rewards"}
    np.savez(tmp_path / "norewards.npz", **missing)
    with pytest.raises(HistoryError, match="field rewards: missing"):
        HistoryStore.load(tmp_path / "norewards.npz")
