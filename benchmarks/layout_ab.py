"""The layout refactor (issue 13) against the code before it: launch and allocation cost.

Runs ``benchmarks/launch.py`` and ``benchmarks/memory.py`` of two trees -- the code before
the layout commit (7432178's parent, *old*) and this one (*new*) -- each in a subprocess
with its own tree first on the path and as its working folder, for ``--rounds`` rounds on
the same machine. Within a round launch runs on both trees, then memory; the trees' order
alternates from round to round. Compared are aiocuda's own figures, which both versions
write under the same names, new over old in each round (the targets take the median over
rounds; no regression beyond noise):

* ``launch_new_vs_old``: ``aiocuda_us``, a bound launcher's launch of an empty kernel;
* ``alloc_free_new_vs_old``: ``aiocuda_alloc_free_1MiB_us``, allocate + free of 1 MiB.

Each side's raw baselines (``raw_prepacked_us``, ``raw_alloc_free_1MiB_us``) and its
ratios to them are reported beside, every round's value kept; they are not like for like
between the sides, as the raw loops were tightened after the layout commit.

The sub-benchmarks run ``--quick`` (``--full``: their full runs, minutes a round on a GPU)
and write their results files into a temporary folder: neither tree's
``benchmarks/results`` is touched. This program's own ``--quick`` makes it one round.

The old tree comes from ``--old PATH``, ``$AIOCUDA_OLD_TREE`` or ``.old-tree`` in the
repository (ignored by git, so the device tool can carry it); without one this program
says so and exits 0. To make it::

    mkdir .old-tree && git archive 7432178^ | tar -x -C .old-tree

    PYTHONPATH=src python3 benchmarks/layout_ab.py [--old PATH] [--rounds 3] [--full]
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

try:
    from benchmarks._common import Result, parser, ratios
except ImportError:  # run as a script from the benchmarks folder
    from _common import Result, parser, ratios  # type: ignore[no-redef]

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The figures each benchmark writes under the same name in both versions (the raw ones
# and the ratios to them on a GPU only).
FIGURES = {
    "launch": ("aiocuda_us", "raw_prepacked_us", "launch_ratio_raw"),
    "memory": (
        "aiocuda_alloc_free_1MiB_us",
        "python_overhead_alloc_free_us",
        "raw_alloc_free_1MiB_us",
        "alloc_free_ratio_raw",
    ),
}
TARGETS = {"launch_new_vs_old": "aiocuda_us", "alloc_free_new_vs_old": "aiocuda_alloc_free_1MiB_us"}
LIMIT = 1.05


def run_benchmark(tree: pathlib.Path, bench: str, scratch: pathlib.Path, full: bool) -> dict[str, float]:
    """Run ``tree``'s ``benchmarks/<bench>.py`` on ``tree``'s code; the figures of
    :data:`FIGURES` that its results file holds."""
    out = scratch / f"{bench}.json"
    # The caller's path, less this tree (the carried wheels of scripts/gpu-check stay).
    others = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and not _inside(p, ROOT)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tree / "src"), str(tree), *others]),
        "AIOCUDA_CACHE_DIR": str(scratch / "cache"),  # kernels compiled by one version only
    }
    command = [sys.executable, f"benchmarks/{bench}.py", "--out", str(out), *([] if full else ["--quick"])]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        sys.exit(f"{tree}/benchmarks/{bench}.py exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}")
    doc = json.loads(out.read_text())
    figures = doc["metrics"] | doc["baselines"]
    return {name: figures[name] for name in FIGURES[bench] if name in figures}


def _inside(path: str, folder: pathlib.Path) -> bool:
    return pathlib.Path(path).resolve().is_relative_to(folder)


def main() -> None:
    cli = parser(__doc__.splitlines()[0])
    default_old = os.environ.get("AIOCUDA_OLD_TREE") or ROOT / ".old-tree"
    cli.add_argument("--old", type=pathlib.Path, default=default_old, help="the tree before the layout commit")
    cli.add_argument("--rounds", type=int, default=3, help="rounds of both benchmarks on both trees")
    cli.add_argument("--full", action="store_true", help="the benchmarks' full runs instead of --quick ones")
    args = cli.parse_args()
    trees = {"old": args.old.resolve(), "new": ROOT}
    if not (trees["old"] / "benchmarks" / "launch.py").is_file():
        print(f"layout_ab: no old tree at {trees['old']}, nothing run; make one with")
        print("    mkdir .old-tree && git archive 7432178^ | tar -x -C .old-tree")
        return
    rounds = 1 if args.quick else args.rounds
    values: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}  # side: figure: one per round
    orders, seconds = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(rounds):
            order = ("old", "new") if round_ % 2 == 0 else ("new", "old")
            started = time.perf_counter()
            for bench in FIGURES:
                for side in order:
                    figures = run_benchmark(trees[side], bench, pathlib.Path(scratch, side), args.full)
                    for name, value in figures.items():
                        values[side].setdefault(name, []).append(value)
            orders.append(" then ".join(order))
            seconds.append(round(time.perf_counter() - started, 1))
            print(f"round {round_ + 1} ({orders[-1]}, {seconds[-1]} s), old -> new:", flush=True)
            for name in values["new"]:
                print(f"    {name}: {values['old'][name][-1]} -> {values['new'][name][-1]}", flush=True)

    result = Result("layout_ab")
    for name in values["new"]:
        for side in ("old", "new"):
            (result.baseline if name.startswith("raw_") else result.metric)(f"{name}_{side}", values[side][name])
    for target, name in TARGETS.items():
        result.target(target, ratios(values["new"][name], values["old"][name]), LIMIT, "<=")
    result.extra = {
        "old_tree": os.path.relpath(trees["old"], ROOT),
        "sub_benchmarks": "full" if args.full else "--quick",
        "orders": orders,
        "seconds_per_round": seconds,
    }
    result.write(args.out)


if __name__ == "__main__":
    main()
