"""Child entry for the inference floor: plain FP32 ONNX Runtime over the calibration data.

    python -m benchmarks._floor --model M.onnx --data calib.npz --batch-size 16 --json out.json

What calibration cannot do with less: run the float model over every calibration batch. The
benchmark runs it twice, on the model with the tensors qtool observes exposed as outputs (what a
calibrator must at least pay in time and memory) and on the model as it is. The session is created
by qtool's own `create_session` from the file path, so settings (providers, threads, sequential
execution, optimisation level, no spinning between runs) are exactly those of qtool's calibration
session; every output of every batch is fetched (as numpy arrays) and dropped. Imports numpy,
onnxruntime and qtool.ort.sessions only: no torch, no kernels, so time and peak memory are
ORT's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from qtool.ort.sessions import create_session


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._floor")
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    with np.load(args.data) as data:
        arrays = {name: data[name] for name in data.files if name != "labels"}
    n = len(next(iter(arrays.values())))
    session = create_session(Path(args.model), spinning=False)  # as qtool's calibration
    names = [o.name for o in session.get_outputs()]
    t0 = time.perf_counter()
    runs = elements = 0
    for i in range(0, n, args.batch_size):
        feed = {name: a[i : i + args.batch_size] for name, a in arrays.items()}
        values = session.run(names, feed)
        elements += sum(v.size for v in values)
        del values
        runs += 1
    Path(args.json).write_text(
        json.dumps(
            {
                "runs": runs,
                "outputs": len(names),
                "output_elements": elements,
                "inference_s": time.perf_counter() - t0,
            }
        )
    )


if __name__ == "__main__":
    main()
