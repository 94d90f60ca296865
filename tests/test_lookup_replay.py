"""The lookup replay (``rhyme_lab/measure/lookup_replay.py``, ``benchmarks/lookup_replay.py``):
lock-step passes of the device's history lookup at a fixed draft room on known tokens, against a
brute-force walk with the brute-force lookup of ``test_chunk_spec``."""

import numpy as np
import pytest

from rhyme_lab.measure.lookup_replay import replay
from test_chunk_spec import _reference


def _walk(prompt, response, history, room, context, width):
    """One row: before each pass the brute-force lookup's draft over ``history ++ own tokens``;
    the accepted prefix plus one token are emitted."""
    hist = np.concatenate([np.r_[h, -1] for h in history])[-width:] if history else np.zeros(0, np.int64)
    hist = np.r_[np.full(width - hist.size, -1), hist] if width else hist
    done, log = 0, []
    while done < response.size:
        own = np.concatenate([prompt, response[:done]])[-context:]
        own = np.r_[np.full(context - own.size, -1), own]
        draft = _reference(list(np.r_[hist, own]), 1, min(room, response.size - done - 1), room, width)
        acc = 0
        while acc < len(draft) and draft[acc] == response[done + acc]:
            acc += 1
        log.append((done, len(draft), acc))
        done += acc + 1
    return log


@pytest.mark.parametrize("room,context,with_history", [(8, 64, False), (32, 16, False), (4, 64, True)])
def test_replay_equals_a_brute_force_walk(room, context, with_history):
    rng = np.random.default_rng(0)
    period = rng.integers(0, 6, 7)
    responses = [np.r_[rng.integers(0, 6, 30), np.tile(period, 12)], rng.integers(0, 6, 50), np.tile([3], 120)]
    prompts = [rng.integers(0, 6, 5) for _ in responses]
    histories = [[responses[(i + 1) % 3][:60]] for i in range(3)] if with_history else None
    width = 96 if with_history else 0
    r = replay(prompts, responses, histories, room=room, context=context, history_width=width)
    for i, (p, resp) in enumerate(zip(prompts, responses)):
        want = _walk(p, resp, histories[i] if histories else [], room, context, width)
        mine = r.log[r.log[:, 0] == i][:, 1:]
        np.testing.assert_array_equal(mine, np.array(want))
        assert r.passes[i] == len(want)
    # one token repeated: the latest match drafts one token until the run is MATCH long, then whole drafts;
    # an own window shorter than MATCH never gets there
    bands = r.accepted_by_band(2, 40)
    if context > 32:
        assert r.passes[2] < responses[2].size // 3 and bands[80] >= room - 1 and bands[0] < 1.5
    else:
        assert r.passes[2] > responses[2].size // 2 and max(bands.values()) <= 1.0
    with pytest.raises(ValueError, match="room"):
        replay(prompts, responses, room=0)


def test_step_report_reads_a_run_and_its_earlier_responses(tmp_path):
    from rhyme_jax.io.rollout_log import save_rollouts
    from rhyme_lab.measure.lookup_replay import earlier_responses, step_report

    rng = np.random.default_rng(1)
    responses = [np.tile(rng.integers(0, 9, 5), 20), rng.integers(0, 9, 30)]
    save_rollouts(tmp_path, 1, np.array([0, 0]), responses, np.zeros(2))
    save_rollouts(tmp_path, 2, np.array([0, 0]), responses[::-1], np.zeros(2))
    (hist,) = earlier_responses(tmp_path, 2, np.array([0]))
    assert [h.size for h in hist] == [100, 30] and earlier_responses(tmp_path, 1, np.array([0])) == [[]]
    own = step_report(tmp_path, 2, top=1)
    both = step_report(tmp_path, 2, top=1, history_width=256)
    assert own["plain_passes"] == both["plain_passes"] == 100 and own["rows"][0]["row"] == 1
    # the same 100 tokens in the history: drafted from the start, where the row's own tokens have no match yet
    assert both["passes"] < own["passes"] < 100
