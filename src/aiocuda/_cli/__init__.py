"""Command-line programs behind ``python -m aiocuda`` (see :mod:`aiocuda.__main__`)."""
