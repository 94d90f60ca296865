"""One GRPO step of the tiny config on 4 devices, as one process or as one of two processes.

``python tests/multihost_case.py OUT.json RUNS_DIR NAME`` runs it in one process (needs 4
devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=4``) with 2 rollout workers.
``... OUT.json RUNS_DIR NAME PROCESS_ID 2 PORT`` is process PROCESS_ID of a two-process run
(2 devices each, ``jax.distributed`` over localhost with gloo CPU collectives, one rollout
worker per process). Both lay the train state out on fsdp=2 x tensor=2, so they must agree:
``OUT.json`` holds the step's rollouts, rewards, metrics and per-leaf parameter checksums.
Used by tests/test_parallel.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str]) -> int:
    out, runs_dir, name = argv[:3]
    overrides = [f"run.runs_dir={runs_dir}", f"run.name={name}", "model.tiny.num_heads=4",
                 "model.tiny.num_kv_heads=2", "model.tiny.head_dim=8", "grpo.steps=1",
                 "parallel.fsdp=2", "parallel.tensor=2", "parallel.rollout_tensor=2",
                 "spec.enabled=true"]
    if len(argv) > 3:
        pid, nproc, port = (int(x) for x in argv[3:6])
        overrides += [f"parallel.coordinator_address=localhost:{port}", f"parallel.num_processes={nproc}",
                      f"parallel.process_id={pid}", "parallel.rollout_workers=1"]
    else:
        overrides += ["parallel.rollout_workers=2"]
    from rhyme_jax.config import load_config
    from rhyme_jax.parallel.reshard import leaf_checksums
    from rhyme_jax.io.rollout_log import load_rollouts
    from rhyme_jax.train.trainer import GRPOTrainer

    import jax

    cfg = load_config(ROOT / "configs" / "tiny_test.yaml", overrides)
    tr = GRPOTrainer(cfg, reward_fn=lambda text, problem: float(len(text) % 2))
    try:
        metrics = tr.train_step(1)
        tr.step = 1
        tr.save()  # Orbax: every process takes part in the save
        checks = leaf_checksums(tr.state).tolist()
        result = {"processes": jax.process_count(), "devices": jax.device_count(),
                  "metrics": metrics, "checksums": checks}
        if jax.process_index() == 0:
            rolled = load_rollouts(tr.run_dir, 1)
            result["responses"] = [r.tolist() for r in rolled["responses"]]
            result["rewards"] = rolled["rewards"].tolist()
            result["saved_step"] = tr.checkpointer.latest_step()
    finally:
        tr.close()
    Path(out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
