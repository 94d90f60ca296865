"""Mesh-sharding checks run in a subprocess with 8 fake CPU devices (tests/test_parallel.py).

``python tests/parallel_cases.py OUT.json [case ...]`` runs the named cases (default: all) and
writes ``{case: {"ok": bool, "detail": str}}``. Each case compares a sharded computation with
the single-device one; the parent test asserts every case's verdict and prints the detail.

Tolerances: a sharded program reduces in another order than the single-device one (partial
sums per device, then a collective), so values differ by ``f32.between_programs`` of one
program's bound (tests/f32.py). For this 2-layer width-32 model the forward bound is 2.3e-4
relative worst case and 8.5e-5 probabilistic (``f32.forward(..., probabilistic=True)``, doubled
for two programs). Parameters after two Adam steps at lr 1e-2 within 1e-4: Adam's update is
about ``lr x sign(g)`` in its first steps, so a relative gradient error e moves it by at most
``lr x e`` = 2.3e-6; loss within 1e-5 and gradient norm within 1e-5 relative rely on the
probabilistic bound of the loss's sum over 8 x 16 tokens (``gamma_prob(128)`` = 1e-6 plus the
per-token 8.5e-5 on terms of O(1e-2)); greedy tokens are
asserted equal and their logprobs within ``f32.logprobs`` (< 1e-4); a resharded copy is
bit-exact (``< 1e-7`` is equality up to the printout).
"""

from __future__ import annotations

import json
import sys
import tempfile
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rhyme_jax.io.checkpoint import Checkpointer  # noqa: E402
from rhyme_jax.model.config import ModelConfig  # noqa: E402
from rhyme_jax.model.loader import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from rhyme_jax.model.transformer import Decoder  # noqa: E402
from rhyme_jax.parallel.mesh import rollout_meshes, train_mesh  # noqa: E402
from rhyme_jax.parallel.reshard import create_sharded, leaf_checksums, put_global, reshard  # noqa: E402
from rhyme_jax.parallel.rules import batch_sharding, opt_state_shardings, param_shardings  # noqa: E402
from rhyme_jax.rollout.engine import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402
from rhyme_jax.train.grpo_step import TrainShardings, make_grpo_step  # noqa: E402
from rhyme_jax.train.optim import make_optimizer  # noqa: E402

CFG = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, tie_word_embeddings=False,
                  eos_token_ids=(1,))


def model() -> Decoder:
    return Decoder(CFG, rngs=nnx.Rngs(0))


def host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def same(a, b) -> bool:
    return all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(host(a), host(b)))


def grpo_batch(rows: int = 16, length: int = 24) -> dict:
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, CFG.vocab_size, (rows, length)).astype(np.int32)
    lens = rng.integers(length // 2, length + 1, rows)
    attn = np.arange(length)[None] < lens[:, None]
    loss = (attn & (np.arange(length)[None] >= 6)).astype(np.float32)
    loss[:, -1] = 0
    return dict(tokens=tokens, positions=np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
                attn_mask=attn, loss_mask=loss,
                old_logprobs=(-rng.random((rows, length - 1)) * 3).astype(np.float32),
                advantages=rng.standard_normal(rows).astype(np.float32))


def case_create_sharded():
    """Sharded creation on fsdp=4 x tensor=2 equals it on one device bit for bit (and eager init
    within rounding); leaves land in the rule's shardings."""
    mesh = train_mesh(1, 4, 2)
    _, state, sh = create_sharded(model, mesh)
    _, one, _ = create_sharded(model, train_mesh(1, 1, 1))
    _, eager = nnx.split(model())
    err = max(float(np.max(np.abs(a - b))) for a, b in zip(host(state), host(eager)))
    q = state["layers"]["attn"]["q_proj"]["kernel"][...]
    ok = same(state, one) and err < 1e-7 and q.sharding.spec == P(None, "fsdp", "tensor") and \
        len(q.addressable_shards) == 8 and q.addressable_shards[0].data.shape[1:] == (8, 16)
    return ok, f"q_proj spec {q.sharding.spec}, shard {q.addressable_shards[0].data.shape}, |jit - eager| {err:.1e}"


def case_train_step():
    """One GRPO update (2 minibatch calls) on fsdp=4 x tensor=2 equals the single-device update."""
    opt = make_optimizer(1e-2, 10, 0, 0.1, 1.0)
    kw = dict(eps_low=0.2, eps_high=0.28, kl_coef=0.0, loss_agg="token_mean", temperature=1.0)
    batch = grpo_batch()
    graphdef, ref_state = nnx.split(model())
    ref_opt = opt.init(ref_state)
    step = make_grpo_step(graphdef, opt, **kw)
    mesh = train_mesh(1, 4, 2)
    _, state, psh = create_sharded(model, mesh)
    osh = opt_state_shardings(opt, jax.eval_shape(opt.init, state), psh, mesh)
    opt_state = jax.jit(opt.init, out_shardings=osh)(state)
    layout = TrainShardings(mesh, psh, osh, batch_sharding(mesh))
    sharded_step = make_grpo_step(graphdef, opt, shardings=layout, **kw)
    for i in range(2):
        mb = {k: v[i * 8:(i + 1) * 8] for k, v in batch.items()}
        ref_state, ref_opt, m_ref = step(ref_state, ref_opt, {k: jnp.asarray(v) for k, v in mb.items()})
        state, opt_state, m = sharded_step(state, opt_state, put_global(mb, layout.batch))
    # Adam normalises each update, so compare with the update's own size (lr 1e-2 per step).
    errs = [float(np.max(np.abs(a - b))) for a, b in zip(host(state), host(ref_state))]
    mu = opt_state[1][0].mu["layers"]["mlp"]["up_proj"]["kernel"][...]
    gn = abs(float(m["grad_norm"]) / float(m_ref["grad_norm"]) - 1)
    ok = (max(errs) < 1e-4 and abs(float(m["loss"]) - float(m_ref["loss"])) < 1e-5 and gn < 1e-5
          and mu.sharding.spec == P(None, "fsdp", "tensor")
          and state["embed"]["embedding"][...].sharding.spec == P("tensor", "fsdp"))
    return ok, (f"max |param diff| {max(errs):.2e}, loss {float(m['loss']):.6f} vs "
                f"{float(m_ref['loss']):.6f}, grad-norm rel diff {gn:.1e}")


def case_reshard_roundtrip():
    """Train layout -> rollout worker layout -> train layout is exact; checksums agree."""
    mesh = train_mesh(1, 4, 2)
    _, state, psh = create_sharded(model, mesh)
    worker = rollout_meshes(2, 4)[3]
    rsh = param_shardings(state, worker)
    rolled = reshard(state, rsh)
    back = reshard(rolled, psh)
    k = rolled["layers"]["attn"]["k_proj"]["kernel"][...]
    ok = (same(state, rolled) and same(state, back)
          and np.array_equal(leaf_checksums(state), leaf_checksums(rolled))
          and set(k.sharding.device_set) == set(worker.devices.flat) and k.sharding.spec == P(None, None, "tensor")
          and back["layers"]["attn"]["k_proj"]["kernel"][...].sharding == psh["layers"]["attn"]["k_proj"]["kernel"].get_value())
    return ok, f"rollout k_proj spec {k.sharding.spec} on devices {sorted(d.id for d in k.sharding.device_set)}"


def case_rollout_tensor_parallel():
    """Greedy rollout on 4 workers x tensor=2 (prompts split over workers) = one device."""
    _, ref_state = nnx.split(model())
    graphdef, _ = nnx.split(nnx.eval_shape(model))
    prompts = [list(np.random.default_rng(i).integers(2, 64, 5 + i % 7)) for i in range(12)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=12)
    kw = dict(max_slots=4, page_size=4, num_pages=0, max_prompt_len=16, max_new_tokens=12, eos_ids=(1,))
    ref = RolloutEngine(graphdef, CFG, EngineConfig(**kw)).generate(ref_state, prompts, sp, jax.random.key(0))
    mesh = train_mesh(1, 4, 2)
    _, state, _ = create_sharded(model, mesh)
    toks, lps = [], []
    for w, wm in enumerate(rollout_meshes(2, 4)):
        eng = RolloutEngine(graphdef, CFG, EngineConfig(**kw), mesh=wm)
        out = eng.generate(reshard(state, param_shardings(state, wm)), prompts[w * 3:(w + 1) * 3], sp,
                           jax.random.key(0))
        toks += out.tokens
        lps += out.logprobs
    ok = all(np.array_equal(a, b) for a, b in zip(toks, ref.tokens)) and len(toks) == len(ref.tokens)
    err = max(float(np.max(np.abs(a - b))) for a, b in zip(lps, ref.logprobs))
    return ok and err < 1e-4, f"{sum(map(len, toks))} tokens equal; max |logprob diff| {err:.1e}"


def case_checkpoint_cross_mesh():
    """Params + optimizer state saved on fsdp=8 restore exactly onto fsdp=2 x tensor=4."""
    opt = make_optimizer(1e-2, 10, 0, 0.1, 1.0)
    src = train_mesh(1, 8, 1)
    _, state, psh = create_sharded(model, src)
    opt_state = jax.jit(opt.init, out_shardings=opt_state_shardings(
        opt, jax.eval_shape(opt.init, state), psh, src))(state)
    opt_state = jax.tree.map(lambda x: x + 1 if x.dtype == jnp.float32 else x, opt_state)
    dst = train_mesh(1, 2, 4)
    _, like, dsh = create_sharded(lambda: Decoder(CFG, rngs=nnx.Rngs(7)), dst)
    like_opt = jax.jit(opt.init, out_shardings=opt_state_shardings(
        opt, jax.eval_shape(opt.init, like), dsh, dst))(like)
    with tempfile.TemporaryDirectory() as d, Checkpointer(d) as ck:
        ck.save(3, params=state, opt_state=opt_state, meta={"step": 3})
        got, got_opt, meta = ck.restore(None, params_like=like, opt_state_like=like_opt)
    v = got["layers"]["mlp"]["down_proj"]["kernel"][...]
    ok = (same(got, state) and same(got_opt, opt_state) and meta["step"] == 3
          and v.sharding.spec == P(None, "tensor", "fsdp") and v.sharding.mesh.shape == dst.shape)
    return ok, f"restored down_proj spec {v.sharding.spec} on mesh {dict(v.sharding.mesh.shape)}"


def case_hf_loader_sharded():
    """The HF loader with a mesh gives the same values as the plain loader, in the rule's shardings."""
    with tempfile.TemporaryDirectory() as d:
        save_hf_checkpoint(model(), d)
        _, plain = load_hf_checkpoint(d)
        _, sharded = load_hf_checkpoint(d, mesh=train_mesh(1, 4, 2))
    o = sharded.layers.attn.o_proj.kernel[...]
    ok = same(nnx.state(plain), nnx.state(sharded)) and o.sharding.spec == P(None, "tensor", "fsdp")
    return ok, f"o_proj spec {o.sharding.spec}"


TINY_PARALLEL = ["model.tiny.num_heads=4", "model.tiny.num_kv_heads=2", "model.tiny.head_dim=8",
                 "grpo.steps=2", "grpo.minibatches=2", "grpo.num_prompts=2", "spec.enabled=true"]


def run_trainer(runs_dir: str, name: str, overrides: list[str], steps=(1, 2)):
    """GRPO steps driven by hand; returns (trainer state on the host, per-step rollouts, metrics)."""
    from rhyme_jax.config import load_config
    from rhyme_jax.train.trainer import GRPOTrainer

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "configs" / "tiny_test.yaml",
                      [f"run.runs_dir={runs_dir}", f"run.name={name}", *TINY_PARALLEL, *overrides])
    tr = GRPOTrainer(cfg, reward_fn=lambda text, problem: float(len(text) % 2))
    rollouts, metrics = [], []
    try:
        for step in steps:
            metrics.append(tr.train_step(step))
            tr.step = step
            from rhyme_jax.io.rollout_log import load_rollouts
            rollouts.append([r.tolist() for r in load_rollouts(tr.run_dir, step)["responses"]])
        return host(tr.state), rollouts, metrics
    finally:
        tr.close()


def case_trainer_layouts():
    """Two GRPO steps (HistoSpec on, 2 minibatches) with the train mesh fsdp=4 x tensor=2 and 2
    rollout workers of tensor=2 equal the same run on one train device with 2 one-device rollout
    workers: identical rollouts, params within float tolerance."""
    with tempfile.TemporaryDirectory() as d:
        flat, r_flat, m_flat = run_trainer(d, "flat", ["parallel.rollout_workers=2"])
        shard, r_shard, m_shard = run_trainer(d, "sharded", [
            "parallel.fsdp=4", "parallel.tensor=2", "parallel.rollout_tensor=2",
            "parallel.rollout_workers=2"])
    err = max(float(np.max(np.abs(a - b))) for a, b in zip(shard, flat))
    ok = r_flat == r_shard and err < 1e-4 and m_shard[0]["rollout/workers"] == 2
    return ok, (f"rollouts equal: {r_flat == r_shard} ({sum(len(x) for x in r_flat[0])} tokens step 1); "
                f"max |param diff| after 2 steps {err:.1e}; accepted drafts step 2: "
                f"{m_shard[1]['spec/accepted_tokens']:.0f}")


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def main(argv: list[str], cases: dict | None = None) -> int:
    """Run ``cases`` (default: this module's) named in ``argv[1:]`` (default: all) and write the
    verdicts to ``argv[0]``."""
    cases = CASES if cases is None else cases
    out_path, names = Path(argv[0]), argv[1:] or list(cases)
    assert jax.device_count() == 8, f"need 8 fake devices, got {jax.device_count()}"
    results = {}
    for name in names:
        try:
            ok, detail = cases[name]()
            results[name] = {"ok": bool(ok), "detail": detail}
        except Exception:  # reported to the parent test with the traceback
            results[name] = {"ok": False, "detail": traceback.format_exc()}
        print(name, results[name], flush=True)
    out_path.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
