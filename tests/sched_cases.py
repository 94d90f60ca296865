"""HistoPipe checks on 8 fake CPU devices: 4 rollout workers x 2 devices (tests/test_sched_workers.py).

``python tests/sched_cases.py OUT.json [case ...]``; same protocol as tests/parallel_cases.py.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from parallel_cases import CFG, main, model, run_trainer  # noqa: E402
from rhyme_jax.config import SchedSection  # noqa: E402
from rhyme_jax.parallel.mesh import rollout_meshes, train_mesh  # noqa: E402
from rhyme_jax.parallel.reshard import create_sharded, reshard  # noqa: E402
from rhyme_jax.parallel.rules import param_shardings  # noqa: E402
from rhyme_jax.rollout.engine import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402
from rhyme_jax.sched.scheduler import RolloutScheduler  # noqa: E402

N = 4  # samples per prompt


def Sched(**kw):  # noqa: N802
    """The ``sched`` config section (histopipe, sync, both tiers, migration) with ``kw`` set."""
    return SchedSection(**{"mode": "histopipe", "pipeline": "sync", "migration": True, **kw})


class Lengths:
    """History stand-in: ``lengths(pid)`` of the previous rollout (long for odd prompt ids)."""

    def lengths(self, pid):
        return np.full(N, 18 if pid % 2 else 3, np.int32)


def _setup():
    graphdef, _ = nnx.split(nnx.eval_shape(model))
    _, state, _ = create_sharded(model, train_mesh(1, 4, 2))
    meshes = rollout_meshes(2, 4)
    kw = dict(max_slots=8, page_size=4, num_pages=0, max_prompt_len=16, max_new_tokens=24, eos_ids=(1,))
    engines = [RolloutEngine(graphdef, CFG, EngineConfig(**kw), mesh=m) for m in meshes]
    states = [reshard(state, param_shardings(state, m)) for m in meshes]
    ids = list(range(8))
    prompts = [list(np.random.default_rng(p).integers(2, 64, 4 + p % 5)) for p in ids for _ in range(N)]
    return engines, states, ids, prompts


def _run(engines, states, ids, prompts, step, **sched):
    sch = RolloutScheduler(engines, Sched(**sched), 24)
    return sch.rollout(step, states, ids, prompts, N, SamplingParams(temperature=0.0, max_new_tokens=24),
                       jax.random.key(0), history=Lengths())


def case_histopipe_same_greedy_responses():
    """Greedy rollouts of 8 prompts x 4 samples on 4 workers: fifo, tier 1 (odd and even step),
    tier 1 + 2, tier 1 + 2 + migration and the spread placement (every prompt's samples on all 4
    workers) give identical responses in row order."""
    engines, states, ids, prompts = _setup()
    ref = _run(engines, states, ids, prompts, 1, mode="fifo")
    others = {name: _run(engines, states, ids, prompts, step, **kw) for name, step, kw in [
        ("tier1_odd", 1, dict(tier2=False, migration=False)), ("tier1_even", 2, dict(tier2=False, migration=False)),
        ("tier12", 1, dict(migration=False)), ("all", 2, {}), ("spread", 1, dict(placement="spread"))]}
    want = [t.tolist() for t in ref.result.tokens]
    same = {k: [t.tolist() for t in v.result.tokens] == want for k, v in others.items()}
    moved = [sorted(r.tolist()) for r in others["tier1_odd"].plan.worker_rows]
    fifo_rows = [sorted(r.tolist()) for r in ref.plan.worker_rows]
    spread = [np.unique(r // N).size for r in others["spread"].plan.worker_rows]
    ok = all(same.values()) and moved != fifo_rows and len(want) == 32 and spread == [8, 8, 8, 8]
    return ok, f"equal: {same}; plans differ from fifo: {moved != fifo_rows}; prompts per worker (spread): {spread}"


def _slowed(run, seconds: float):
    """``run`` (an engine's ``_run``) that first sleeps ``seconds`` on every decode/verify pass."""
    import time

    def slow(flat_state, inp, *args, **kw):
        if getattr(inp, "draft_lens", None) is not None:
            time.sleep(seconds)
        return run(flat_state, inp, *args, **kw)

    return slow


def case_migrated_tokens_equal_unmigrated():
    """Forced migration (growth 0.01, tail fraction 1.0): tails stopped on their worker are
    continued at once on an idle one and end with exactly the tokens and (within 1e-4) logprobs
    they have without migration."""
    engines, states, ids, prompts = _setup()
    ref = _run(engines, states, ids, prompts, 1, migration=False)
    # worker 0 is a straggler (20 ms more per pass), so the others go idle while it still decodes
    # whatever the host threads' timing (without it the workers could all finish in one pass)
    engines[0]._run = _slowed(engines[0]._run, 0.02)
    mig = _run(engines, states, ids, prompts, 1, growth=0.01, tail_fraction=1.0)
    del engines[0]._run
    share = mig.metrics["sched/migrated_share"]
    kinds = {iv.kind for iv in mig.intervals}
    toks = [t.tolist() for t in mig.result.tokens] == [t.tolist() for t in ref.result.tokens]
    err = max(float(np.max(np.abs(a - b))) for a, b in zip(mig.result.logprobs, ref.result.logprobs))
    # A tail is handed over when it is stopped: some migrated row starts on another worker while
    # its source worker is still decoding its own batch.
    batch_end = {iv.worker: iv.end for iv in mig.intervals if iv.kind == "batch"}
    early = any(iv.kind == "migrated" and iv.worker != iv.source and iv.start < batch_end[iv.source]
                for iv in mig.intervals)
    ok = toks and err < 1e-4 and share > 0 and "migrated" in kinds and early
    return ok, (f"migrated share {share:.3f}, interval kinds {sorted(kinds)}, handed over while the "
                f"source decodes {early}, tokens equal {toks}, |dlogprob| {err:.1e}")


def case_trainer_histopipe_run():
    """Two GRPO steps with sched.mode=histopipe on 4 workers x tensor 2 (sampling at temperature
    1): every row of each step comes back once, in row order (same prompt ids as fifo), sched
    metrics are logged and the per-step schedule files written."""
    from rhyme_jax.io.rollout_log import load_rollouts

    with tempfile.TemporaryDirectory() as d:
        common = ["parallel.rollout_tensor=2", "parallel.rollout_workers=4", "grpo.prompts_per_step=4"]
        run_trainer(d, "fifo", common)
        _, r_hp, m_hp = run_trainer(d, "histopipe", common + ["sched.mode=histopipe"])
        ids = [load_rollouts(Path(d) / name, 2)["prompt_ids"].tolist() for name in ("fifo", "histopipe")]
        files = sorted(p.name for p in (Path(d) / "histopipe" / "schedule").iterdir())
        bubble = [m["sched/bubble_fraction"] for m in m_hp]
    ok = (ids[0] == ids[1] and len(ids[1]) == 16 and all(len(r) == 16 for r in r_hp)
          and files == ["step_000001.json", "step_000002.json"]
          and all(0.0 <= b < 1.0 for b in bubble) and m_hp[1]["sched/ascending"] == 0.0)
    return ok, f"prompt ids as fifo {ids[0] == ids[1]}; bubble {bubble}; files {files}"


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], CASES))
