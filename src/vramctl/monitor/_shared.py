"""For vramctl's other packages only: the monitor's HTTP helpers that the server uses (binding
rules, address parsing, the metrics text, static files).

Not the public surface (that is ``vramctl.monitor``); the import contracts let sibling
packages import this module and no other private one of ``vramctl.monitor``.
"""

from __future__ import annotations

from vramctl.monitor._http import check_bind, parse_address
from vramctl.monitor._plot import static_file
from vramctl.monitor._prometheus import metrics_text

__all__ = ["check_bind", "metrics_text", "parse_address", "static_file"]
