"""For vramctl's other packages only: the fit's helpers that other vramctl packages use (the
search's arithmetic and host copies, for the Accelerate integration; the fit cache's
folder).

Not the public surface (that is ``vramctl.fit``); the import contracts let sibling packages
import this module and no other private one of ``vramctl.fit``.
"""

from __future__ import annotations

from vramctl.fit._cache import cache_root
from vramctl.fit._probe import to_host
from vramctl.fit._search import Search

__all__ = ["Search", "cache_root", "to_host"]
