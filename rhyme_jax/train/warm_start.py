"""``rhyme-jax sft``: supervised warm start on worked solutions before GRPO.

Writes ``<run_dir>/sft/`` (params checkpoint, metrics.jsonl, TensorBoard events) and the run's
tokenizer.json; a later ``rhyme-jax train`` with the same run name starts from these params.
"""

from __future__ import annotations

from pathlib import Path

from flax import nnx

from rhyme_jax.config import RunConfig
from rhyme_jax.data import load_problems, task_reward
from rhyme_jax.io import checkpoint as ckpt
from rhyme_jax.train.evaluate import EvalResult, evaluate_run
from rhyme_jax.train.policy import build_model, build_tokenizer, compute_params, eos_ids, rollout_dtype
from rhyme_jax.train.preflight import prepare
from rhyme_jax.train.reporting import metrics_writer
from rhyme_jax.train.sft import run_sft


def sft_params_dir(run_dir: Path) -> Path:
    """Where the warm-start parameters of a run are saved."""
    return Path(run_dir) / "sft" / "params"


def run_warm_start(cfg: RunConfig, run_dir: Path) -> EvalResult:
    """Train the policy on ``prompt + solution + <eos>`` for ``sft.steps`` steps, save it, and
    report held-out greedy accuracy.

    Returns:
      The held-out ``EvalResult`` of the SFT policy (scored by the config's reward).

    Raises:
      RewardError: ``reward.fn`` cannot be used (before any work).
    """
    # Imported here: the assembly module pulls in the engine, which the SFT path does not need
    # until evaluation.
    from rhyme_jax.train.assembly import make_engine

    prepare(cfg)
    run_dir = Path(run_dir)
    reward = task_reward(cfg)  # a bad reward.fn fails before any work
    train, held_out = load_problems(cfg.data)
    tokenizer = build_tokenizer(cfg, run_dir, train)
    model = build_model(cfg, tokenizer, cfg.run.seed)
    writer = metrics_writer(cfg, run_dir / "sft", job_type="sft")
    model = run_sft(model, tokenizer, train, cfg.sft, prompt_template=cfg.model.prompt_template,
                    seed=cfg.run.seed, progress=cfg.run.progress,
                    log_fn=lambda step, m: writer.log(step, m, phase="sft"))
    graphdef, state = nnx.split(model)
    ckpt.save_params(sft_params_dir(run_dir), state)
    engine = make_engine(graphdef, model.cfg, cfg, eos_ids(model, tokenizer))
    # The saved params are the float32 master weights; the engine runs on a rollout-dtype copy (as
    # the GRPO rollout does: RolloutParts.states), so both compile the same programs.
    res = evaluate_run(engine, compute_params(state, rollout_dtype(cfg)), tokenizer, held_out, cfg,
                       reward_fn=reward)
    writer.log(cfg.sft.steps, res.as_metrics(), phase="eval")
    writer.close()
    return res
