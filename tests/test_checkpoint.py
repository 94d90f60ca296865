"""Orbax checkpoints: exact round trip, pruning, and survival of a save killed mid-way."""

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rhyme_jax.io.checkpoint import CheckpointError, Checkpointer, load_params, save_params
from rhyme_jax.model.config import ModelConfig
from rhyme_jax.model.transformer import Decoder
from rhyme_jax.train.optim import make_optimizer

CFG = dict(family="qwen3", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
           num_heads=2, num_kv_heads=1, head_dim=8)


@functools.lru_cache(maxsize=None)
def make_state(seed=0):
    """Full nnx state of a tiny Decoder and an AdamW state after one update (non-trivial moments).

    Cached: the arrays are immutable and never donated in these tests.
    """
    _, state = nnx.split(Decoder(ModelConfig(**CFG), rngs=nnx.Rngs(seed)))
    tx = make_optimizer(1e-2, 10, 2, 0.1, 1.0)

    @jax.jit
    def one_update(state):
        opt = tx.init(state)
        grads = jax.tree.map(lambda x: jnp.full_like(x, 0.5), state)
        return tx.update(grads, opt, state)[1]

    return state, one_update(state)


def assert_tree_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_exact_and_abstract_like(tmp_path):
    state, opt = make_state()
    meta = {"step": 5, "rng": [0, 42], "data_position": 80, "eval_before": {"acc": 0.25}}
    with Checkpointer(tmp_path / "ck", keep=2) as ck:
        assert ck.latest_step() is None
        ck.save(5, params=state, opt_state=opt, meta=meta)
        assert ck.latest_step() == 5
    # a fresh process-like reopen, restoring into abstract structures
    with Checkpointer(tmp_path / "ck") as ck:
        p, o, m = ck.restore(None, params_like=jax.eval_shape(lambda: state),
                             opt_state_like=jax.eval_shape(lambda: opt))
        assert_tree_equal(p, state)
        assert_tree_equal(o, opt)
        assert m == meta
        p2, o2, _ = ck.restore(5, params_like=state, opt_state_like=None)  # eval: params only
        assert_tree_equal(p2, state)
        assert o2 is None


def test_keep_prunes_and_latest(tmp_path):
    states = [make_state(seed) for seed in range(4)]
    ck = Checkpointer(tmp_path, keep=2)
    for step, (s, o) in zip((10, 20, 30, 40), states):
        ck.save(step, params=s, opt_state=o, meta={"step": step})
    assert ck.all_steps() == [30, 40] and ck.latest_step() == 40
    p, _, m = ck.restore(30, params_like=states[2][0], opt_state_like=states[2][1])
    assert_tree_equal(p, states[2][0])
    assert m == {"step": 30}
    with pytest.raises(CheckpointError, match="step 10 not in"):
        ck.restore(10, params_like=states[0][0], opt_state_like=states[0][1])
    # re-saving an existing step replaces it
    ck.save(40, params=states[0][0], opt_state=states[0][1], meta={"step": 40, "again": True})
    p, _, m = ck.restore(40, params_like=states[0][0], opt_state_like=states[0][1])
    assert_tree_equal(p, states[0][0])
    assert m["again"] is True
    ck.close()


def test_errors(tmp_path):
    state, opt = make_state()
    ck = Checkpointer(tmp_path)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        ck.restore(None, params_like=state, opt_state_like=opt)
    with pytest.raises(CheckpointError, match="JSON"):
        ck.save(1, params=state, opt_state=opt, meta={"x": object()})
    ck.save(1, params=state, opt_state=opt, meta={})
    wrong = {"other": jnp.zeros(3)}
    with pytest.raises(CheckpointError):
        ck.restore(1, params_like=wrong, opt_state_like=opt)
    ck.close()
    with pytest.raises(CheckpointError, match="keep"):
        Checkpointer(tmp_path, keep=0)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_params(tmp_path / "nope", state)


def test_stray_partial_dirs_are_ignored(tmp_path):
    state, opt = make_state()
    ck = Checkpointer(tmp_path, keep=3)
    ck.save(1, params=state, opt_state=opt, meta={"step": 1})
    ck.close()
    # leftovers of a crash: orbax's tmp dir and a step-named dir with no commit marker
    junk = tmp_path / "2.orbax-checkpoint-tmp-1700000000"
    (junk / "params").mkdir(parents=True)
    (junk / "params" / "garbage").write_bytes(b"\x00garbage")
    (tmp_path / "3").mkdir()
    (tmp_path / "3" / "garbage").write_text("half written")
    ck = Checkpointer(tmp_path, keep=3)
    assert ck.latest_step() == 1
    p, o, m = ck.restore(None, params_like=state, opt_state_like=opt)
    assert_tree_equal(p, state)
    assert m == {"step": 1}
    ck.close()


KILL_SCRIPT = textwrap.dedent("""
    import os, sys
    import jax, jax.numpy as jnp
    from flax import nnx
    from orbax.checkpoint._src.path import atomicity
    sys.path.insert(0, {tests!r})
    from test_checkpoint import make_state
    from rhyme_jax.io.checkpoint import Checkpointer

    state, opt = make_state(0)
    ck = Checkpointer({d!r}, keep=3)
    ck.save(1, params=state, opt_state=opt, meta={{"step": 1}})

    async def die(self, *a, **k):  # all item data written, killed before the atomic rename
        os._exit(17)

    atomicity.AtomicRenameTemporaryPath.finalize = die
    state2 = jax.tree.map(lambda x: x + 1, state)
    ck.save(2, params=state2, opt_state=opt, meta={{"step": 2}})
    print("save returned")  # not reached
""")


def test_process_killed_mid_save(tmp_path):
    d = tmp_path / "ck"
    script = KILL_SCRIPT.format(tests=str(Path(__file__).parent), d=str(d))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          cwd=str(Path(__file__).parents[1]), timeout=300)
    assert proc.returncode == 17, proc.stderr[-2000:]
    assert any(".orbax-checkpoint-tmp" in n for n in os.listdir(d))  # the partial save is there
    state, opt = make_state(0)
    ck = Checkpointer(d, keep=3)
    assert ck.latest_step() == 1
    p, o, m = ck.restore(None, params_like=state, opt_state_like=opt)
    assert_tree_equal(p, state)
    assert_tree_equal(o, opt)
    assert m == {"step": 1}
    # and the run can carry on saving the step that was lost
    ck.save(2, params=state, opt_state=opt, meta={"step": 2})
    assert ck.all_steps() == [1, 2]
    ck.close()


def test_save_load_params(tmp_path):
    state, _ = make_state(3)
    save_params(tmp_path / "params", state)
    save_params(tmp_path / "params", state)  # overwriting is allowed
    like = jax.eval_shape(lambda: make_state(4)[0])
    assert_tree_equal(load_params(tmp_path / "params", like), state)
    # into a model: replaces its weights
    model = Decoder(ModelConfig(**CFG), rngs=nnx.Rngs(9))
    graphdef, fresh = nnx.split(model)
    nnx.update(model, load_params(tmp_path / "params", fresh))
    assert_tree_equal(nnx.state(model), state)


def _per_block(nested):
    """The pre-scan layout of a nested checkpoint tree: ``layers/<i>/...`` per block."""
    if not isinstance(nested, dict):
        return nested
    out = {}
    for key, child in nested.items():
        if key == "layers":
            n = jax.tree.leaves(child)[0].shape[0]
            out[key] = {str(i): jax.tree.map(lambda x: np.asarray(x)[i], child) for i in range(n)}
        else:
            out[key] = _per_block(child)
    return out


def test_per_block_checkpoint_converts_to_stacked_layers(tmp_path):
    """A checkpoint written before the layer scan (one subtree per block) restores into the
    stacked layout, params and optimizer moments exactly; a warm-start params dir too."""
    from rhyme_jax.io.checkpoint import _to_nested

    state, opt = make_state()
    old_params, old_opt = _per_block(_to_nested(state)), _per_block(_to_nested(opt))
    assert "0" in old_params["layers"] and "1" in old_params["layers"]
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(3, params=old_params, opt_state=old_opt, meta={"step": 3})
    with Checkpointer(tmp_path / "ck") as ck:
        p, o, m = ck.restore(None, params_like=jax.eval_shape(lambda: state),
                             opt_state_like=jax.eval_shape(lambda: opt))
    assert_tree_equal(p, state)
    assert_tree_equal(o, opt)
    assert m == {"step": 3}
    save_params(tmp_path / "sft", old_params)
    assert_tree_equal(load_params(tmp_path / "sft", state), state)
    # a per-block checkpoint of another depth fails with the path named
    with pytest.raises(CheckpointError, match="layers"):
        load_params(tmp_path / "sft", nnx.split(Decoder(ModelConfig(**{**CFG, "num_layers": 3}),
                                                        rngs=nnx.Rngs(0)))[1])
