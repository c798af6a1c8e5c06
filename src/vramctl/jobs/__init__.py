"""Sharing GPUs among jobs: job specs, admission and placement by memory, the queue.

The layer between the run-time layers (``fit``, ``batching``, ``monitor``, ``guard``,
``estimator``) and the interfaces (``server``, ``cli``).
"""

from __future__ import annotations

__all__: list[str] = []
