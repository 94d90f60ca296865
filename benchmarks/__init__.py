"""Benchmark entry points: thin scripts over the library's public API.

Run each from the repository root as ``python -m benchmarks.NAME`` (``--help`` lists its options);
what they share lives in the library (``rhyme_jax.measure``, ``rhyme_jax.ablate``), never here.
"""
