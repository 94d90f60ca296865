"""What the benchmark entry points (``python -m benchmarks.NAME``) measure, on a real model or a
kernel: the top floor beside ``ablate`` (it may import every package below the CLI; nothing below
imports it, and it never imports ``rhyme_jax.cli``).

* ``schedule_real``: HistoPipe's cost-model profile and real-worker runs (``benchmarks.schedule``);
* ``real_workload``, ``rollout_real``, ``peers``: the SmolLM2 / GSM8K rollout workload, plain vs
  HistoSpec on it, and peer engines on it (``benchmarks.rollout_real``, ``benchmarks.peers``);
* ``kernels``, ``kernel_checks``, ``kernel_report``: the ragged paged attention sweep, its
  correctness checks and its report (``benchmarks.kernels``);
* ``attention_layout``: the reference's per-sequence vs per-token layout timed per step shape
  (``benchmarks.attention_layout``);
* ``trl_mapping``, ``trl_run``, ``trl_report``: TRL's GRPOTrainer on a rhyme-jax config
  (``benchmarks.trl_side_by_side``; TRL, torch and transformers are imported only inside the
  functions that run them).
"""
