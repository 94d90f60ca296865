"""Run outputs: metrics jsonl + TensorBoard, the summary plot, and the per-step rollout archive."""

import json

import numpy as np
import pytest

from rhyme_jax.io.metrics import MetricsError, MetricsWriter, read_metrics
from rhyme_jax.io.plots import plot_run
from rhyme_jax.io.rollout_log import RolloutLogError, list_rollout_steps, load_rollouts, save_rollouts

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _tb_events(tb_dir):
    """(tag, step, value) scalars as TensorBoard shows them: event files read in name order, and a
    SessionLog START at step s (tensorboardX ``purge_step``) hides earlier events with step >= s."""
    import struct

    from tensorboardX.proto import event_pb2

    out = []
    for f in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = f.read_bytes()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            ev = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4  # length, length crc, payload, payload crc
            if ev.HasField("session_log") and ev.session_log.status == ev.session_log.START:
                out = [x for x in out if x[1] < ev.step]
            for v in ev.summary.value:
                out.append((v.tag, ev.step, v.simple_value))
    return out


def test_metrics_jsonl_and_tensorboard(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=True) as w:
        w.log(0, {"reward/mean": 0.25, "loss": np.float32(1.5)})
        w.log(1, {"reward/mean": 0.5, "loss": 1.25, "nan_metric": float("nan")})
        w.log(1, {"eval/accuracy": 0.4}, phase="eval")
        with pytest.raises(MetricsError, match="step"):
            w.log(2, {"step": 3})
        with pytest.raises(MetricsError, match="'bad'"):
            w.log(2, {"bad": "x"})
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["phase"]) for r in rows] == [(0, "train"), (1, "train"), (1, "eval")]
    assert rows[0] == {"step": 0, "phase": "train", "reward/mean": 0.25, "loss": 1.5}
    assert np.isnan(rows[1]["nan_metric"])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and all(isinstance(json.loads(l), dict) for l in lines)
    events = _tb_events(tmp_path / "tb")
    assert ("reward/mean", 1, 0.5) in events
    assert ("train/loss", 0, 1.5) in events
    assert ("eval/accuracy", 1, pytest.approx(0.4)) in events
    assert not any(tag == "train/nan_metric" for tag, _, _ in events)


def test_read_metrics_tolerates_truncated_last_line(tmp_path):
    assert read_metrics(tmp_path) == []
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 0, "phase": "train", "r": 1.0}\n{"step": 1, "phase": "train", "r": 2.0}\n{"step": 2, "ph')
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    # A writer opened on the damaged file repairs it before appending.
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.log(2, {"r": 3.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    assert all(json.loads(l) for l in f.read_text().splitlines())
    # Corruption in the middle is an error naming file:line.
    f.write_text('{"step": 0}\nGARBAGE\n{"step": 2}\n')
    with pytest.raises(MetricsError, match=r"metrics.jsonl:2:"):
        read_metrics(tmp_path)


def test_truncate_from_drops_rows_atomically(tmp_path):
    with MetricsWriter(tmp_path) as w:
        for s in range(6):
            w.log(s, {"reward/mean": s / 10})
        w.log(5, {"eval/accuracy": 0.5}, phase="eval")
    with MetricsWriter(tmp_path, truncate_from=3) as w:
        assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
        w.log(3, {"reward/mean": 0.9})
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["reward/mean"]) for r in rows] == [(0, 0.0), (1, 0.1), (2, 0.2), (3, 0.9)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "tb"]  # no temp files
    # TensorBoard's purge_step drops the old steps >= 3 on reload.
    events = _tb_events(tmp_path / "tb")
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 2  # first file not clobbered
    assert [(s, v) for tag, s, v in events if tag == "reward/mean"] == [
        (0, 0.0), (1, pytest.approx(0.1)), (2, pytest.approx(0.2)), (3, pytest.approx(0.9))]
    assert not any(tag == "eval/accuracy" for tag, _, _ in events)


def test_plot_run_writes_png(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.log(0, {"eval/accuracy": 0.1}, phase="eval")
        for s in range(5):
            w.log(s, {"reward/mean": s / 5, "response_length/mean": 20 + s})
        w.log(5, {"eval/accuracy": 0.6}, phase="eval")
    out = plot_run(tmp_path)
    assert out == tmp_path / "reward_accuracy.png"
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC
    import matplotlib.image as mpimg

    img = mpimg.imread(out)
    assert img.shape[1] == 1500 and img.shape[0] == 400  # three 5x4 inch panels at 100 dpi
    # Robust to missing keys / no metrics at all: two "no data" panels.
    empty = tmp_path / "empty"
    out2 = plot_run(empty)
    assert out2.read_bytes()[:8] == PNG_MAGIC and mpimg.imread(out2).shape[:2] == (400, 1000)


def test_rollouts_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    n = 7
    prompt_ids = rng.integers(0, 1000, n).astype(np.int64)
    responses = [rng.integers(0, 50000, rng.integers(0, 30)).astype(np.int32) for _ in range(n)]
    responses[2] = np.zeros(0, np.int32)
    rewards = rng.random(n).astype(np.float32)
    lps = [-rng.random(len(r)).astype(np.float32) for r in responses]
    p = save_rollouts(tmp_path, 12, prompt_ids, responses, rewards, lps)
    assert p == tmp_path / "rollouts" / "step_000012.npz"
    save_rollouts(tmp_path, 3, prompt_ids[:2], responses[:2], rewards[:2])
    save_rollouts(tmp_path, 100, prompt_ids, responses, rewards)
    save_rollouts(tmp_path, 3, prompt_ids[:2], responses[:2], rewards[:2] + 1)  # overwrite
    got = load_rollouts(tmp_path, 12)
    np.testing.assert_array_equal(got["prompt_ids"], prompt_ids)
    np.testing.assert_array_equal(got["rewards"], rewards)
    np.testing.assert_array_equal(got["lengths"], [len(r) for r in responses])
    assert got["prompt_ids"].dtype == np.int64 and got["rewards"].dtype == np.float32
    assert len(got["responses"]) == n
    for a, b in zip(got["responses"], responses):
        assert a.dtype == np.int32 and np.array_equal(a, b)
    for a, b in zip(got["behaviour_logprobs"], lps):
        np.testing.assert_array_equal(a, b)
    raw = np.load(p)
    assert raw["tokens"].dtype == np.int32 and raw["offsets"].dtype == np.int64
    np.testing.assert_array_equal(raw["offsets"], np.concatenate([[0], np.cumsum([len(r) for r in responses])]))
    np.testing.assert_array_equal(load_rollouts(tmp_path, 3)["rewards"], rewards[:2] + 1)
    assert "behaviour_logprobs" not in load_rollouts(tmp_path, 3)
    assert list_rollout_steps(tmp_path) == [3, 12, 100]
    assert sorted(x.name for x in (tmp_path / "rollouts").iterdir()) == [
        "step_000003.npz", "step_000012.npz", "step_000100.npz"]  # atomic: no temp files left
    assert list_rollout_steps(tmp_path / "nothing") == []


def test_rollouts_bad_input(tmp_path):
    r = [np.arange(3), np.arange(2)]
    with pytest.raises(RolloutLogError, match="prompt_ids"):
        save_rollouts(tmp_path, 0, np.arange(3), r, np.zeros(2))
    with pytest.raises(RolloutLogError, match="rewards"):
        save_rollouts(tmp_path, 0, np.arange(2), r, np.zeros(3))
    with pytest.raises(RolloutLogError, match=r"behaviour_logprobs\[1\]"):
        save_rollouts(tmp_path, 0, np.arange(2), r, np.zeros(2), [np.zeros(3), np.zeros(5)])
    with pytest.raises(RolloutLogError, match=r"responses\[0\]"):
        save_rollouts(tmp_path, 0, np.arange(2), [np.zeros((2, 2), int), np.arange(2)], np.zeros(2))
    with pytest.raises(RolloutLogError, match="step 5"):
        load_rollouts(tmp_path, 5)
    assert list_rollout_steps(tmp_path) == []
    (tmp_path / "rollouts").mkdir(exist_ok=True)
    (tmp_path / "rollouts" / "step_000007.npz").write_bytes(b"not a zip")
    with pytest.raises(RolloutLogError, match="unreadable"):
        load_rollouts(tmp_path, 7)
