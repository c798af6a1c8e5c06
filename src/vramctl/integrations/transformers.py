"""vramctl for the Hugging Face ``Trainer``: monitoring, a fitted batch size, OOM recovery.

Three pieces, each usable on its own (``pip install 'vramctl[transformers]'``):

- :class:`VramctlCallback`, a ``TrainerCallback``: a :class:`vramctl.Monitor` on the
  training device from ``on_train_begin`` to ``on_train_end``; leak detection at every
  optimizer step (``monitor.step()``); memory readings (``vramctl/used_gib``,
  ``vramctl/peak_gib``, and a guarded trainer's ``vramctl/ooms`` ...) added to every log, so
  that they are in ``trainer.state.log_history`` and, with :meth:`VramctlCallback.attach`,
  reach the reporting integrations (TensorBoard, W&B ...); alerts logged as warnings (or
  above) and leak reports as warnings; ``stop_on_leak=True`` stops training at a leak.
- :func:`fit_trainer_batch_size`, the replacement for ``auto_find_batch_size``: called
  before the ``Trainer`` is built, it fits the per-device batch with
  :func:`vramctl.fit.fit_batch_size` (a few real steps like the Trainer's, seeded by the
  estimator, cached) and splits the effective batch into per-device batch and
  accumulation steps exactly (:func:`vramctl.integrations.split_effective_batch`).
- :class:`GuardedTrainer` (or :class:`GuardedTrainingMixin` for your own ``Trainer``
  subclass): a ``training_step`` that survives an out-of-memory error in forward or
  backward. The batch is run again in pieces by a :class:`vramctl.Guard`, each piece's loss
  computed as the Trainer computes it, so the accumulated gradients are the whole batch's;
  the piece size grows back to whole batches after ``patience`` good steps.

One process and one device: DeepSpeed, FSDP and multi-GPU runs are not supported by the
guarded training step (a clear error says so). See ``docs/integrations.md``.
"""

from __future__ import annotations

from vramctl.integrations._hf_batch import TrainerBatchSize, fit_trainer_batch_size
from vramctl.integrations._hf_callback import PREFIX as PREFIX
from vramctl.integrations._hf_callback import VramctlCallback
from vramctl.integrations._hf_common import TrainerIntegrationError
from vramctl.integrations._hf_trainer import REDUCTIONS as REDUCTIONS
from vramctl.integrations._hf_trainer import GuardedTrainer, GuardedTrainingMixin

__all__ = [
    "GuardedTrainer",
    "GuardedTrainingMixin",
    "TrainerBatchSize",
    "TrainerIntegrationError",
    "VramctlCallback",
    "fit_trainer_batch_size",
]
