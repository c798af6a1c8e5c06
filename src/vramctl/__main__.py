"""``python -m vramctl``: the same as the ``vramctl`` command."""

from vramctl.cli import main

main()
