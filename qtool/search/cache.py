"""The analysis cache: every measured variant, stored under a key of everything it depends on.

The key covers the prepared model's fingerprint, the stats (and Hessian) file digests, the
analysis samples (their bytes, not just their count), the recipe's quantization, calibration
and evaluation settings, the deployment CPU and the qtool / ONNX Runtime versions. Mode and
candidates are not part of it: they select *which* variants are needed, each stored under its
own id, so `--mode all` after `--mode one-at-a-time` measures only the variants not seen yet,
and an unchanged rerun measures nothing. A file that cannot be read is ignored and replaced.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from qtool.io import atomic_write_text
from qtool.search.layers import LayerScore
from qtool.search.result import Measurement, json_number

CACHE_DIR = "analysis-cache"
# 2: measurements carry the margin noise (accuracy and agreement); files of 1 are measured again
_FORMAT = "qtool-analysis-cache-2"


def cache_key(inputs: dict) -> str:
    """SHA-256 of the key inputs (JSON with sorted keys, so dict order does not matter)."""
    text = json.dumps(inputs, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class AnalysisCache:
    """Measurements of one key, read from and written to `<folder>/analysis-cache/<key>.json`."""

    def __init__(self, folder: Path, key: str, inputs: dict, enabled: bool = True) -> None:
        self.path = Path(folder) / CACHE_DIR / f"{key[:32]}.json"
        self.key = key
        self.inputs = inputs
        self.enabled = enabled
        self.variants: dict[str, Measurement] = {}
        self.header: dict = {}
        self.layer: tuple[float, list[LayerScore]] | None = None
        if enabled:
            self._read()

    def _read(self) -> None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            return
        if data.get("key") != self.key:
            return
        try:
            self.header = dict(data["header"])
            self.variants = {k: Measurement.from_dict(v) for k, v in data["variants"].items()}
            if data.get("layer") is not None:
                layer = data["layer"]
                self.layer = (float(layer["seconds"]), [_layer(d) for d in layer["scores"]])
        except (KeyError, TypeError, ValueError):
            self.header, self.variants, self.layer = {}, {}, None

    def save(self) -> None:
        if not self.enabled:
            return
        layer = None
        if self.layer is not None:
            seconds, scores = self.layer
            layer = {"seconds": round(seconds, 4), "scores": [_layer_dict(s) for s in scores]}
        data = {
            "format": _FORMAT,
            "key": self.key,
            "inputs": self.inputs,
            "header": self.header,
            "variants": {k: self.variants[k].to_dict() for k in sorted(self.variants)},
            "layer": layer,
        }
        text = json.dumps(data, indent=1, sort_keys=True, default=str, allow_nan=False)
        atomic_write_text(self.path, text + "\n")


def _layer_dict(score: LayerScore) -> dict:
    return {
        "node": score.node,
        "op_type": score.op_type,
        "precision": score.precision,
        "output": score.output,
        "sqnr_out_db": json_number(score.sqnr_out_db),
        "input": score.input,
        "sqnr_in_db": None if score.sqnr_in_db is None else json_number(score.sqnr_in_db),
    }


def _layer(data: dict) -> LayerScore:
    return LayerScore(
        data["node"],
        data["op_type"],
        data["precision"],
        data["output"],
        float(data["sqnr_out_db"]),
        data["input"],
        None if data["sqnr_in_db"] is None else float(data["sqnr_in_db"]),
    )
