"""docs/ci.md's pipeline runs as written: its shell block on a copy of the digits example.

The block is taken from the document itself (the ```bash fence after the "tested" marker), so the
documentation cannot drift from what works; the GitHub Actions step must be the same script.
The first run calibrates and fills the cache; a second run, up to the quantized model, must
quantize from the cached stats.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ci.md"
MARKER = "<!-- tested: tests/test_docs_ci.py"


def _fence(text: str, language: str, after: int = 0) -> str:
    """The body of the first ```language fence at or after position `after`."""
    match = re.compile(rf"^```{language}\n(.*?)^```$", re.S | re.M).search(text, after)
    assert match, f"no ```{language} block in {DOC}"
    return match.group(1)


def _tested_block() -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index(MARKER)
    return _fence(text, "bash", start)


def test_github_actions_step_is_the_tested_script() -> None:
    workflow = yaml.safe_load(_fence(DOC.read_text(encoding="utf-8"), "yaml"))
    steps = workflow["jobs"]["quantize"]["steps"]
    (step,) = [s for s in steps if s.get("name") == "Quantize and evaluate"]
    assert step["run"] == _tested_block()
    uploaded = next(s for s in steps if "upload-artifact" in s.get("uses", ""))
    assert uploaded["if"] == "always()"  # reports are kept when the gate fails
    assert "report.json" in uploaded["with"]["path"]


def _run(block: str, cwd: Path) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "qtool"
    bin_dir = str(script.parent) if script.is_file() else str(Path(shutil.which("qtool")).parent)
    env = dict(os.environ)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    # The package under test, not whatever copy the console script was installed from.
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        ["bash", "-c", block], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_ci_shell_block_runs_on_the_digits_example(tmp_path: Path) -> None:
    examples = tmp_path / "examples"
    shutil.copytree(
        ROOT / "examples" / "digits",
        examples / "digits",
        ignore=shutil.ignore_patterns("out", "__pycache__"),
    )
    block = _tested_block()

    first = _run(block, tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "from the cache" not in first.stdout
    suite = ET.parse(tmp_path / "report.xml").getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures")) == ("1", "0")
    (case,) = suite.findall("testcase")
    assert "accuracy drop <= 1 points" in case.get("name")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] is True and report["gates"][0]["limit"] == 1.0
    assert (examples / "digits" / "out" / "model.int8.onnx").is_file()
    (cached,) = (tmp_path / ".qtool-cache").glob("stats-*.npz")
    assert cached.read_bytes() == (examples / "digits" / "out" / "stats.npz").read_bytes()

    # Again up to the quantized model (the evaluation is what the first run checked, and the
    # suite's time budget is tight): the cached stats must give the byte-identical model.
    model = examples / "digits" / "out" / "model.int8.onnx"
    first_model = model.read_bytes()
    model.unlink()
    lines = block.rstrip("\n").split("\n")
    assert lines[-1].startswith("qtool evaluate ")
    second = _run("\n".join(lines[:-1]) + "\n", tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"from the cache: .qtool-cache/{cached.name}" in second.stdout
    assert model.read_bytes() == first_model
