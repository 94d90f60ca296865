"""Ground floor: what a run writes and reads back, and the file formats under it (imports nothing above it).

- ``atomic``: write-then-rename files and directories (checkpoints, history, logs).
- ``jsonl``: the JSON-lines reader (``read_jsonl``): records and errors name ``<path>:<line>``.
- ``checkpoint``: atomic, resumable train-state checkpoints (orbax) and their metadata.
- ``metrics``: ``metrics.jsonl`` (and TensorBoard) writers and the reader.
- ``rollout_log``: the per-step rollout log (``rollouts/step_*.npz``).
- ``plots``: the run's metric plots from ``metrics.jsonl``.
- ``summary``: the end-of-run summary (``summary.json``/``.md``), eval file paths, paired gains.

The merged Hugging Face export (``rhyme-jax export``) builds a model, so it sits in ``train/export``.
"""
