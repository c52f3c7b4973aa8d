"""The check that refuses a quantized model made from another float model than the one given.

Comparing a quantized model with a float model it was not made from prints a "drop" that is
really a mix-up. qtool stamps the float model's sha256 into every model it writes
(qtool/model/provenance.py); evaluate compares it with the float model it is handed.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from qtool.errors import ModelError
from qtool.metrics.results import EvalWarning
from qtool.model import provenance


def check_provenance(
    fp32_path: Path,
    quant_proto: onnx.ModelProto,
    quant_path: Path,
    allow_foreign: bool,
    fp32_proto: onnx.ModelProto | None = None,
) -> tuple[dict, list[EvalWarning]]:
    """Refuse a quantized model that records another float model than `fp32_path`.

    A mismatch is an error unless the user says they mean it (allow_foreign). The float model's
    hash covers its external data files (`fp32_proto`: its proto without them, when already
    read).
    """
    recorded = provenance.read(quant_proto)
    info: dict = {"recorded": recorded}
    expected = recorded.get(provenance.FLOAT_MODEL_SHA256)
    if expected is None:
        info["status"] = "unknown"
        what = "no qtool provenance" if not recorded else f"no {provenance.FLOAT_MODEL_SHA256}"
        message = (
            f"{quant_path} has {what} in its metadata, so evaluate cannot check that it was "
            f"quantized from {fp32_path}"
        )
        return info, [EvalWarning("no_provenance", message)]
    actual = provenance.sha256_model(fp32_path, fp32_proto)
    info["fp32_sha256"] = actual
    if actual == expected:
        info["status"] = "match"
        return info, []
    if actual == recorded.get(provenance.SOURCE_MODEL_SHA256):
        # the user's model itself: the float model it was prepared from computes the same
        # function (a model over 2 GB leaves no float copy unless the recipe asks for one)
        info["status"] = "match: source model"
        return info, []
    info["status"] = "mismatch"
    message = (
        f"{quant_path} was not derived from {fp32_path}: it records float model sha256 "
        f"{expected[:16]}..., {fp32_path.name} has {actual[:16]}..."
    )
    if not allow_foreign:
        raise ModelError(f"{message} (pass --allow-foreign-fp32 to compare them anyway)")
    return info, [EvalWarning("foreign_fp32", f"{message}; compared anyway (--allow-foreign-fp32)")]
