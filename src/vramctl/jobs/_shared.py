"""For vramctl's other packages only: the job queue's helpers that the server uses (a device's
capacity for jobs).

Not the public surface (that is ``vramctl.jobs``); the import contracts let sibling packages
import this module and no other private one of ``vramctl.jobs``.
"""

from __future__ import annotations

from vramctl.jobs._need import device_capacity

__all__ = ["device_capacity"]
