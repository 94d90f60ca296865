"""Ground floor: file formats and atomic writes shared by every layer (imports nothing above it).

- ``atomic``: write-then-rename files and directories (checkpoints, history, logs).
- ``jsonl``: the JSON-lines reader (``read_jsonl``): records and errors name ``<path>:<line>``.
- ``rollout_log``: the per-step rollout log (``rollouts/step_*.npz``) the trainer writes and
  ``spec.analyze`` reads.
"""
