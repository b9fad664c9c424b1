"""``python -m aiocuda`` (or the ``aiocuda`` command): ``info``, ``demo``, ``bench``.

The commands live in :mod:`aiocuda._cli`; ``main`` is the console script's entry point.
"""

from __future__ import annotations

import sys

from ._cli.main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
