"""``aiocuda bench``: run the benchmark programs of a source checkout (``benchmarks/``).

Each benchmark runs as its own process, with ``--quick`` passed on. ``benchmarks/results/``
holds full runs on a real GPU only (``benchmarks/_common.py`` refuses to write there from
the simulator or a quick run); a run that will not be written says so before it starts.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import subprocess
import sys
import textwrap
from typing import Any

from ..backend import current_backend
from .common import UsageError, prog_name

__all__ = ["add_parser", "benchmarks"]

_ROOT = pathlib.Path(__file__).resolve().parents[3] / "benchmarks"


def benchmarks() -> dict[str, str]:
    """Every benchmark of the source checkout, by name, with its one-line summary (empty
    outside a checkout)."""
    found = {}
    for script in sorted(_ROOT.glob("[a-z]*.py")) if _ROOT.is_dir() else []:
        doc = ast.get_docstring(ast.parse(script.read_text(encoding="utf-8"))) or ""
        found[script.stem] = doc.split("\n\n")[0].replace("\n", " ").replace("``", "")
    return found


def add_parser(commands: Any) -> None:
    """Add ``bench`` to the ``commands`` of the top-level parser."""
    known = benchmarks()
    listing = "\n".join(f"  {name:<15} {summary}" for name, summary in known.items())
    parser = commands.add_parser(
        "bench",
        help="run the benchmarks (source checkout only)",
        description=textwrap.fill(
            "Run benchmark programs, each measuring aiocuda against its baselines in the same run. Results are "
            "written to benchmarks/results/ only from a full run on a real GPU."
        ),
        epilog=f"benchmarks:\n{listing}" if known else "benchmarks: none here (they come with a source checkout)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="few repetitions (a smoke run; nothing is written)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    known = benchmarks()
    if not known:
        print(f"{prog_name()} bench: the benchmarks come with a source checkout ({_ROOT} not found)", file=sys.stderr)
        return 1
    unknown = [name for name in args.names if name not in known]
    if unknown:
        raise UsageError(f"no benchmark named {', '.join(map(repr, unknown))}; choose from: {', '.join(known)}")
    unwritten = "on the SIMULATED backend (no GPU)" if current_backend().simulated else None
    unwritten = unwritten or ("a --quick run" if args.quick else None)
    if unwritten:
        print(
            f"{prog_name()} bench: {unwritten}: figures to look at, not to keep; nothing is written to "
            "benchmarks/results/, which holds full runs on a real GPU",
            flush=True,
        )
    passed_on = ["--quick"] if args.quick else []
    status = 0
    for name in args.names or known:
        status |= subprocess.call([sys.executable, str(_ROOT / f"{name}.py"), *passed_on])
    return 1 if status else 0
