"""Start-up cost of qtool commands against a bare interpreter, in fresh processes.

`qtool --help` and every command on an ONNX source must be ready in under a second of imports
(issue 10): torch and scikit-learn load only when a recipe exports a PyTorch model or reads
sklearn data. Each row is the median CPU seconds of `--runs` fresh interpreters (wall time on a
shared machine is noise), next to `python -c pass` measured in the same run.

    python -m benchmarks.startup [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks._measure import run_measured

CASES = {
    "python -c pass (baseline)": [sys.executable, "-c", "pass"],
    "qtool --help": [sys.executable, "-m", "qtool.cli", "--help"],
    "import qtool.cli": [sys.executable, "-c", "import qtool.cli"],
    "imports of an ONNX-source run": [
        sys.executable,
        "-c",
        "import qtool.app.quantize, qtool.metrics.evaluate, qtool.runtime.fusion",
    ],
    "import torch (for comparison)": [sys.executable, "-c", "import torch"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/startup.json"))
    args = parser.parse_args()
    from qtool.ort.cpu import detect_cpu

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, command in CASES.items():
            runs = [run_measured(command, Path(tmp) / "log.txt", 120) for _ in range(args.runs)]
            failed = [r for r in runs if not r.ok]
            if failed:
                rows[name] = {"status": failed[0].status}
                continue
            rows[name] = {
                "cpu_s": statistics.median(r.cpu_s for r in runs),
                "wall_s": statistics.median(r.wall_s for r in runs),
                "peak_mb": statistics.median(r.peak_mb for r in runs),
            }
    base = rows["python -c pass (baseline)"].get("cpu_s", 0.0)
    print(f"CPU: {detect_cpu().describe()}; median of {args.runs} fresh processes\n")
    print("| command | CPU s | minus bare python | wall s | peak MB |")
    print("|---|---|---|---|---|")
    for name, row in rows.items():
        if "cpu_s" not in row:
            print(f"| {name} | {row['status']} | | | |")
            continue
        extra = row["cpu_s"] - base
        print(
            f"| {name} | {row['cpu_s']:.2f} | {extra:+.2f} | {row['wall_s']:.2f} | "
            f"{row['peak_mb']:.0f} |"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"cpu": detect_cpu().to_dict(), "runs": args.runs, "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
