"""Run ``mypy --strict`` on a user's module, as a user's type checker would see aiocuda."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"


def assert_passes_mypy_strict(tmp_path: pathlib.Path, filename: str, code: str) -> None:
    """Write ``code`` (dedented) to ``tmp_path / filename`` and check it with ``mypy
    --strict`` against this tree's sources; skips where mypy is not installed."""
    pytest.importorskip("mypy")
    user = tmp_path / filename
    user.write_text(textwrap.dedent(code))
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"), str(user)],
        env={"MYPYPATH": str(SRC), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
