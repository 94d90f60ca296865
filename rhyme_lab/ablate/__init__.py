"""``python -m rhyme_lab ablate``: the paper's ablations (docs/reproduction.md) from ``configs/ablations``.

A thin layer on top of the package: it builds runs from configs and drives ``train``, ``sched``,
``spec`` and ``rollout`` as the trainer and the benchmarks do; nothing in the package imports it
(only ``rhyme_jax.cli`` registers the command).

* ``registry``: the ablation ids, what each varies and measures, the paper's figure, the units
  (runs) each needs, and the scales (``tiny`` for tests, ``quick``, ``full`` CPU).
* ``units``: the runs shared by several ids (demo SFT, end-to-end GRPO runs on 4 rollout
  workers, a paired plain/HistoSpec GRPO run, the real-model rollout session); each writes one
  JSON, atomically, and runs in its own process (fake CPU devices need ``XLA_FLAGS`` before JAX
  starts).
* ``replay``: the drafter replayed along saved rollouts (acceptance, tokens per forward, hit
  rate, draft lengths) for the HistoSpec knobs.
* ``measures``: each id's figures from the units; ``report``: table.md, results.csv, plots.
* ``runner``: resumable orchestration with progress bars.
"""
