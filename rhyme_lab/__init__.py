"""rhyme-lab: the measurement apparatus beside the rhyme-jax product (not part of its wheel).

What trains lives in ``rhyme_jax`` (the package ``pip install`` gives users); what measures it
lives here, in the same repository, and runs from the repository root after the README's install:
``python -m rhyme_lab ablate paper --quick`` (the paper's ablations), ``python -m rhyme_lab analyze
RUN_DIR`` (RhymeRL's observations O5/O6), ``python -m rhyme_lab replay-drafts FILE.jsonl`` and the
``python -m benchmarks.NAME`` entry points.

* ``ablate/``: the ablation ids and suites, their shared runs ("units") and reports.
* ``measure/``: drafter and pass replays, oracle drafters, bounds, timing harnesses.
* ``bench/``: what the real-model, kernel, peer and TRL benchmarks measure.
* ``schedule/``: HistoPipe's planner replayed over saved lengths and its cost-model profile.
* ``analyze.py``: O5 / O6 over saved rollouts; ``provenance.py``: the stamp of a measurement.
* ``cli/``: the ``python -m rhyme_lab`` commands.

The lab imports the product; the product never imports the lab (``tests/test_layout.py``). It
reaches into a training run only through the trainer's callback seam
(``rhyme_jax.train.callbacks.TrainerCallback``).
"""
