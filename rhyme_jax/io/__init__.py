"""Ground floor: file formats and atomic writes shared by every layer (imports nothing above it).

- ``atomic``: write-then-rename files and directories (checkpoints, history, logs).
- ``rollout_log``: the per-step rollout log (``rollouts/step_*.npz``) the trainer writes and
  ``spec.analyze`` reads.
"""
