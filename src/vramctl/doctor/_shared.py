"""For vramctl's other packages only: the doctor's helpers that other vramctl packages use
(the allocator settings' parser, for the CLI's ``--alloc-conf``).

Not the public surface (that is ``vramctl.doctor``); the import contracts let sibling
packages import this module and no other private one of ``vramctl.doctor``.
"""

from __future__ import annotations

from vramctl.doctor._torch import parse_alloc_conf

__all__ = ["parse_alloc_conf"]
