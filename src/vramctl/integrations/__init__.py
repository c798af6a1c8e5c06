"""vramctl where users already train: Lightning, the Hugging Face ``Trainer``, Accelerate.

Each framework has its own module, imported on its own (each needs its framework installed):

- :mod:`vramctl.integrations.lightning` (``pip install 'vramctl[lightning]'``):
  ``VramctlBatchSize``, ``VramctlGuard`` and ``VramctlMonitor`` callbacks;
- :mod:`vramctl.integrations.transformers` (``pip install 'vramctl[transformers]'``): a
  ``TrainerCallback`` for monitoring, ``fit_trainer_batch_size`` in place of
  ``auto_find_batch_size``, and a guarded ``training_step``;
- :mod:`vramctl.integrations.accelerate` (``pip install 'vramctl[accelerate]'``): a
  drop-in ``find_executable_batch_size``.

This package itself holds what they share: :func:`split_effective_batch`, the
per-device batch and accumulation steps for a wanted effective batch, and
:func:`batch_maker`, a batch of any size from a dataset and its collate function.
See ``docs/integrations.md``.
"""

from __future__ import annotations

from vramctl.integrations._data import batch_maker, split_effective_batch

__all__ = ["batch_maker", "split_effective_batch"]
