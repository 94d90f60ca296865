"""What sets the rollout's share of a step on a machine: the two phases' FLOPs against their seconds.

A rollout with a KV cache computes one forward pass over every token of its rows (each sample's
prompt prefilled once, then one token a decode pass). The update runs the same tokens forward and
backward: about 3x a forward pass (2N FLOPs a token forward, 6N forward and backward: Kaplan et
al. 2020, "Scaling Laws for Neural Language Models", s.2.1; the attention's backward in
FlashAttention-2's count is 2.5x its forward, and ``configs/longtail.yaml`` runs no remat). With
``F`` the rollout's FLOPs, ``e_R`` and ``e_U`` the FLOP rates the rollout and the update reach,
and ``rest`` the step's other seconds::

    share = R / (R + U + rest),  R = F / e_R,  U = 3 F / e_U
          = 1 / (1 + 3 e_R / e_U + rest / R)

So at equal rates a rollout is at most a quarter of a step (``rest = 0``), and a share of ``s``
needs the update to run ``3 s / (1 - s)`` times the rollout's FLOP rate (7x for 70%). RhymeRL's
84-91% (arXiv 2508.18588, s.2) is that gap on GPUs, where decoding reads the weights and the KV
cache for a few tokens a pass and training runs its products at a large batch. This module
counts the FLOPs of each saved step from the run's own lengths (prompt and response tokens of
every row) and the model's shapes, and reports per epoch each phase's GFLOP/s, the gap
``e_U / e_R`` and the share it implies. Where the update leaves rows out (rows of advantage 0
under ``grpo.skip_zero_advantage_rows`` or ``grpo.dynamic_sampling``: ``updated_rows``), its FLOPs
are ``3 q F`` with ``q`` the share of the rollout's forward FLOPs in the rows it keeps, and
``share = 1 / (1 + 3 q e_R / e_U + rest / R)``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

UPDATE_OVER_FORWARD = 3.0  # forward + backward over forward (module docstring)


def matmul_params(m) -> int:
    """Weights a token meets in matrix products: per layer q, k, v, o and the SwiGLU's three
    matrices, times the layers, plus the output head (``ModelConfig`` ``m``)."""
    d, hd = m.hidden_size, m.head_dim
    attn = d * hd * (2 * m.num_heads + 2 * m.num_kv_heads)
    mlp = 3 * d * m.intermediate_size
    return m.num_layers * (attn + mlp) + d * m.vocab_size


def forward_flops(m, lengths) -> float:
    """FLOPs of one causal forward pass over sequences of ``lengths`` tokens each: ``2 N`` a token
    in the products (``matmul_params``) and, per layer, ``4 H hd`` a (query, earlier key) pair for
    the scores and the weighted values (``sum_n n (n + 1) / 2`` pairs)."""
    n = np.asarray(lengths, np.float64)
    pairs = float(np.sum(n * (n + 1) / 2))
    return 2.0 * matmul_params(m) * float(n.sum()) + m.num_layers * 4.0 * m.num_heads * m.head_dim * pairs


def run_model_config(cfg, run_dir: Path, train):
    """The ``ModelConfig`` a run trained: its checkpoint's (``model.path``, as
    ``train.memory_plan.model_config_of`` finds it), else ``model.tiny`` with the run's tokenizer."""
    from rhyme_jax.train.memory_plan import model_config_of
    from rhyme_jax.train.policy import build_tokenizer, tiny_model_config

    if cfg.model.path:
        return model_config_of(cfg, "")[0]
    return tiny_model_config(cfg, build_tokenizer(cfg, run_dir, train))


def updated_rows(cfg, rewards, lengths) -> np.ndarray:
    """``bool[N]``: the rows of a step the update computes on. The packed update leaves out rows
    without loss tokens (an empty response; a truncated one under
    ``grpo.mask_truncated_completions``) and, under ``grpo.skip_zero_advantage_rows``, rows of
    advantage 0 (``train/packing.py``); ``grpo.dynamic_sampling`` drops such rows' groups before any
    update, packed or padded."""
    from rhyme_jax.train.losses import group_advantages

    g, lengths = cfg.grpo, np.asarray(lengths)
    keep = np.ones(lengths.shape, bool)
    if g.padding_free:  # the padded update computes on every row
        keep &= lengths > 0
        if g.mask_truncated_completions:
            keep &= lengths < cfg.rollout.max_new_tokens
    if (g.padding_free and g.skip_zero_advantage_rows) or g.dynamic_sampling:  # DS drops the groups in any layout
        groups = np.asarray(rewards, np.float32).reshape(-1, g.samples_per_prompt)
        adv = np.asarray(group_advantages(groups, scale_rewards=g.scale_rewards)).reshape(-1)
        keep &= np.nan_to_num(adv) != 0
    return keep


def step_flops(run_dir) -> dict[int, tuple[float, float]]:
    """Forward FLOPs of every saved step of the run in ``run_dir`` (``rollouts/step_*.npz`` and
    ``config.yaml``): ``(rollout, update)``, the first over every row (prompt + response tokens:
    the plain rollout's FLOPs), the second over the rows the update computes on
    (``updated_rows``); the update's FLOPs are ``UPDATE_OVER_FORWARD`` times it.

    Raises:
      FileNotFoundError: no ``config.yaml`` in ``run_dir``.
    """
    from rhyme_jax.config import load_config
    from rhyme_jax.data import load_problems
    from rhyme_jax.io.rollout_log import list_rollout_steps, load_rollouts
    from rhyme_jax.train.policy import build_tokenizer
    from rhyme_jax.train.prompts import PromptTokens

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir / 'config.yaml'}: no such file")
    cfg = load_config(str(run_dir / "config.yaml"), [])
    train, _ = load_problems(cfg.data)
    model = run_model_config(cfg, run_dir, train)
    tokens = PromptTokens(build_tokenizer(cfg, run_dir, train), train, cfg.model.prompt_template)
    plen: dict[int, int] = {}
    out = {}
    for step in list_rollout_steps(run_dir):
        ro = load_rollouts(run_dir, step)
        for p in np.unique(ro["prompt_ids"]):
            plen.setdefault(int(p), len(tokens(int(p))))
        rows = np.array([plen[int(p)] for p in ro["prompt_ids"]], np.float64) + ro["lengths"]
        keep = updated_rows(cfg, ro["rewards"], ro["lengths"])
        out[step] = (forward_flops(model, rows), forward_flops(model, rows[keep]))
    return out


def epoch_rates(r: dict, flops: dict[int, tuple[float, float]]) -> list[dict]:
    """Per epoch of a paired unit ``r`` (its steps' ``plain`` rollout seconds and ``time/train_s``),
    over the steps that compiled nothing: rollout and update GFLOP/s (``flops``: ``step_flops``'s
    rollout and update forward FLOPs), the gap ``e_U / e_R``, the update's share of the rollout's
    FLOPs ``q`` (the rows it computes on), the rollout share measured (plain rollout over plain
    rollout + the step's rest) and the share the gap gives (``1 / (1 + 3 q / gap)``)."""
    from rhyme_lab.ablate.learning import by_epoch

    rows = []
    for ep, st in sorted(by_epoch(r).items()):
        st = [s for s in st if s.get("compiles", 1) == 0 and s["step"] in flops and s.get("time/train_s")]
        if not st:
            continue
        f = sum(flops[s["step"]][0] for s in st)
        f_u = sum(flops[s["step"]][1] for s in st)
        roll = sum(s["plain"]["seconds"] for s in st)
        upd = sum(s["time/train_s"] for s in st)
        rest = sum(s["wall_s"] - s["plain"]["seconds"] - s["spec"]["seconds"] for s in st)
        e_r, e_u = f / roll, UPDATE_OVER_FORWARD * f_u / upd
        rows.append({"epoch": ep, "steps": len(st), "rollout_gflop": f / 1e9, "rollout_gflops": e_r / 1e9,
                     "update_gflops": e_u / 1e9, "gap": e_u / e_r, "updated": f_u / f, "share": roll / (roll + rest),
                     "share_of_gap": 1.0 / (1.0 + UPDATE_OVER_FORWARD * (f_u / f) * e_r / e_u)})
    return rows


def table_lines(rows: list[dict]) -> list[str]:
    """Markdown table of ``epoch_rates``."""
    out = ["| epoch | steps (no compile) | rollout GFLOP a step | rollout GFLOP/s | update GFLOP/s | gap e_U / e_R | "
           "update FLOPs / rollout's (3x q) | rollout share | share from the gap and q |",
           "|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        out.append(f"| {x['epoch']} | {x['steps']} | {x['rollout_gflop'] / x['steps']:.1f} | {x['rollout_gflops']:.2f} | "
                   f"{x['update_gflops']:.2f} | {x['gap']:.2f} | 3 x {x['updated']:.2f} | {x['share']:.1%} | "
                   f"{x['share_of_gap']:.1%} |")
    return out


__all__ = ["UPDATE_OVER_FORWARD", "epoch_rates", "forward_flops", "matmul_params", "run_model_config", "step_flops",
           "table_lines", "updated_rows"]
