"""Benchmark entry points: thin scripts over the library's public API.

Run each from the repository root as ``python -m benchmarks.NAME`` (``--help`` lists its options);
what they share lives in the library, never here: ``rhyme_lab.measure`` (replays, oracle drafters,
pass and draft costs, paired reports), ``rhyme_jax.sched`` (HistoPipe replay and profiling),
``rhyme_lab.ablate`` (saved-run corpora, update cost) and ``rhyme_lab.bench`` (the kernel sweep and
checks, real-model workloads, peer engines, TRL side by side).
"""
