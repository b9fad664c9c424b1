"""The README and docs/ say what the code and the GPU results say.

Their measured figures and the engine constants they quote are generated
(``scripts/results-table``): a figure edited by hand, a changed constant or a new
results file without regenerated docs fails here. Its list of markers is the one
pytest registers, and every registered marker is used by a test.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_doc_figures_match_the_results_files_and_the_code() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "results-table"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_marker_is_used_and_documented() -> None:
    (block,) = re.findall(r"^markers = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.MULTILINE | re.DOTALL)
    names = set(re.findall(r'^\s*"(\w+):', block, re.MULTILINE))
    assert names >= {"gpu", "multi_gpu"}, block
    tests = "\n".join(path.read_text() for path in (ROOT / "tests").glob("*.py"))
    unused = {name for name in names if f"mark.{name}" not in tests}
    assert not unused, f"markers no test uses: {unused}"
    readme = (ROOT / "README.md").read_text()
    (markers_line,) = re.findall(r"^- Markers: .*(?:\n  .*)*", readme, re.MULTILINE)
    assert set(re.findall(r"`(\w+)`", markers_line)) == names, markers_line
