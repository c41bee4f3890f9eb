"""``python -m kvquant``: the same command line as the ``kvquant`` script."""

from __future__ import annotations

from kvquant.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
