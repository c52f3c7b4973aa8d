"""CI gates on an evaluation: which limits hold, judged on the fused model, and a JUnit report.

A gate is judged on the quantized model as ONNX Runtime fuses it, because that is what deploys;
the unfused (QDQ) value is recorded beside it so a failure caused by the kernels rather than the
quantization is visible. Each gate passes or fails on its own, so a report says which limit broke.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass

from qtool.metrics.evaluate import VARIANTS, EvalResult, format_db, json_float


@dataclass(frozen=True)
class Gates:
    """The CI gates, all judged on the gated output of the fused model (what deploys).

    metric None means accuracy with labels, else top-1 agreement. Cosine is the gate for
    embeddings, where top-1 agreement means nothing.
    """

    metric: str | None = None
    max_drop: float | None = None
    min_cosine: float | None = None
    min_sqnr: float | None = None


@dataclass
class GateResult:
    gate: str  # "max_drop" | "min_cosine" | "min_sqnr"
    output: str
    metric: str  # "accuracy" | "agreement" | "cosine" | "sqnr_db"
    value: float  # fused: the number judged
    unfused_value: float  # for reference only
    limit: float
    passed: bool

    @property
    def title(self) -> str:
        """A name that stays the same from run to run (CI systems track tests by name)."""
        if self.gate == "max_drop":
            return f"{self.output}: {self.metric} drop <= {self.limit:g} points"
        if self.gate == "min_cosine":
            return f"{self.output}: cosine >= {self.limit:g}"
        return f"{self.output}: SQNR >= {self.limit:g} dB"

    def describe(self) -> str:
        if self.gate == "max_drop":
            return (
                f"output {self.output!r}: {self.metric} dropped {self.value:.2f} points "
                f"(limit {self.limit:.2f}; unfused {self.unfused_value:.2f})"
            )
        if self.gate == "min_cosine":
            return (
                f"output {self.output!r}: cosine {self.value:.5f} (floor {self.limit:g}; "
                f"unfused {self.unfused_value:.5f})"
            )
        return (
            f"output {self.output!r}: SQNR {format_db(self.value)} dB (floor {self.limit:g} dB; "
            f"unfused {format_db(self.unfused_value)} dB)"
        )

    def to_dict(self) -> dict:
        return {
            "gate": self.gate,
            "output": self.output,
            "metric": self.metric,
            "model": "fused",
            "value": json_float(self.value),
            "unfused_value": json_float(self.unfused_value),
            "limit": self.limit,
            "passed": self.passed,
        }


def judge_gates(result: EvalResult, gates: Gates) -> list[GateResult]:
    """Each active gate passes or fails on its own, judged on the fused model."""
    judged: list[GateResult] = []
    output = result.output
    if gates.max_drop is not None:
        metric = gates.metric or result.default_metric()
        drop = result.drop_points(metric)
        unfused = result.drop_points(metric, "unfused")
        judged.append(
            GateResult(
                "max_drop", output, metric, drop, unfused, gates.max_drop, drop <= gates.max_drop
            )
        )
    gated = result.gated()
    if gates.min_cosine is not None:
        value = gated.fused.cosine
        judged.append(
            GateResult(
                "min_cosine",
                output,
                "cosine",
                value,
                gated.unfused.cosine,
                gates.min_cosine,
                value >= gates.min_cosine,
            )
        )
    if gates.min_sqnr is not None:
        value = gated.fused.sqnr_db
        judged.append(
            GateResult(
                "min_sqnr",
                output,
                "sqnr_db",
                value,
                gated.unfused.sqnr_db,
                gates.min_sqnr,
                value >= gates.min_sqnr,
            )
        )
    return judged


# ---------------------------------------------------------------------------------------------
# JUnit


def junit_xml(result: EvalResult, gates: Iterable[GateResult]) -> bytes:
    """A JUnit XML report, one testcase per gate, that CI systems (GitHub, GitLab, Jenkins) show
    natively. No timestamps or durations, so the same numbers give the same bytes."""
    gates = list(gates)
    failures = sum(not g.passed for g in gates)
    counts = {"tests": str(len(gates)), "failures": str(failures), "errors": "0"}
    root = ET.Element("testsuites", {"name": "qtool evaluate", **counts})
    suite = ET.SubElement(root, "testsuite", {"name": "qtool evaluate", **counts, "skipped": "0"})
    properties = ET.SubElement(suite, "properties")
    summary = {
        "fp32_model": str(result.fp32_path or ""),
        "quant_model": str(result.quant_path or ""),
        "samples": str(result.samples),
        "gated_output": result.output,
        "cpu": "" if result.cpu is None else result.cpu.describe(),
    }
    for out in result.outputs:
        for variant in VARIANTS:
            metrics = out.variant(variant)
            summary[f"{out.name}.{variant}.sqnr_db"] = format_db(metrics.sqnr_db)
            summary[f"{out.name}.{variant}.cosine"] = f"{metrics.cosine:.6f}"
            if metrics.agreement is not None:
                summary[f"{out.name}.{variant}.agreement"] = f"{metrics.agreement:.6f}"
            if metrics.accuracy is not None:
                summary[f"{out.name}.{variant}.accuracy"] = f"{metrics.accuracy:.6f}"
        if out.fp32_accuracy is not None:
            summary[f"{out.name}.fp32.accuracy"] = f"{out.fp32_accuracy:.6f}"
    for name, value in summary.items():
        ET.SubElement(properties, "property", {"name": name, "value": value})
    for gate in gates:
        case = ET.SubElement(
            suite, "testcase", {"classname": "qtool.metrics.evaluate", "name": gate.title}
        )
        if not gate.passed:
            failure = ET.SubElement(
                case, "failure", {"message": gate.describe(), "type": "QuantizationGate"}
            )
            failure.text = f"FAIL (fused model, what deploys): {gate.describe()}"
        ET.SubElement(case, "system-out").text = gate.describe()
    if result.warnings:
        text = "\n".join(f"warning: {w.message}" for w in result.warnings)
        ET.SubElement(suite, "system-err").text = text
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n"
