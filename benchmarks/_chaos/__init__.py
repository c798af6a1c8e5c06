"""oom_chaos.py's generic parts: the workload, the memory, the co-tenant, the runs, the peers.

- ``workload``: the data, the model, the plain step, and the tally that counts each
  sample's share of an update;
- ``memory``: where the loops run (a simulated GPU, a real one, the plain CPU),
  checkpoints, and the budget a loop is given;
- ``cotenant``: the seeded schedule of grabs and releases, played in this process or in
  a second one (``worker`` is that process, and its self-test);
- ``runs``: a run's row, the references, and what its outputs are compared with;
- ``peers``: the unguarded runs and Accelerate's.
"""
