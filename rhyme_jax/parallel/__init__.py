"""Device meshes, logical-axis sharding rules, resharding and multi-host start-up.

- ``mesh``: the train mesh (``data``, ``fsdp``, ``tensor``) and the rollout workers' sub-meshes.
- ``rules``: logical axis -> mesh axis table, parameter / optimizer / batch / KV-pool shardings,
  activation constraints.
- ``reshard``: sharded model creation, weight sync, host batch -> global array, checksums.
- ``distributed``: ``jax.distributed.initialize`` from config or environment.
"""
