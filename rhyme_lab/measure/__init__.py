"""Measurement over the library's public pieces (drafters replayed along texts, ...): used by the
``rhyme-jax`` commands, ``rhyme_lab.ablate`` and ``benchmarks/``. Above ``rollout``, ``spec`` and
``sched``; below ``train``, ``ablate`` and ``cli``."""
