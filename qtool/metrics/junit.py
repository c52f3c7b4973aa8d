"""The judged gates as a JUnit XML report, which CI systems (GitHub, GitLab, Jenkins) show.

One testcase per gate, a <failure> for each failed one, every metric of every output in the
suite's <properties>. No timestamps or durations, so the same numbers give the same bytes.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterable

from qtool.metrics.gates import GateResult
from qtool.metrics.results import VARIANTS, EvalResult
from qtool.metrics.signal import format_db


def junit_xml(result: EvalResult, gates: Iterable[GateResult]) -> bytes:
    """The report of `gates` judged on `result`. The testcases keep the classname they had when
    this lived in qtool.metrics.evaluate: CI systems track tests by classname and name."""
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
            if metrics is None:  # no fused variant (float8 on the CPU)
                continue
            summary[f"{out.name}.{variant}.sqnr_db"] = format_db(metrics.sqnr_db)
            summary[f"{out.name}.{variant}.cosine"] = f"{metrics.cosine:.6f}"
            if metrics.agreement is not None:
                summary[f"{out.name}.{variant}.agreement"] = f"{metrics.agreement:.6f}"
            if metrics.accuracy is not None:
                summary[f"{out.name}.{variant}.accuracy"] = f"{metrics.accuracy:.6f}"
            if metrics.perplexity is not None:
                summary[f"{out.name}.{variant}.perplexity"] = f"{metrics.perplexity:.6f}"
            if metrics.kl is not None:
                summary[f"{out.name}.{variant}.kl"] = f"{metrics.kl:.6g}"
        if out.fp32_accuracy is not None:
            summary[f"{out.name}.fp32.accuracy"] = f"{out.fp32_accuracy:.6f}"
        if out.fp32_perplexity is not None:
            summary[f"{out.name}.fp32.perplexity"] = f"{out.fp32_perplexity:.6f}"
            summary[f"{out.name}.tokens"] = str(out.tokens)
        if out.fused_vs_unfused is not None:
            gap = out.fused_vs_unfused
            summary[f"{out.name}.fused_vs_unfused.sqnr_db"] = format_db(gap.sqnr_db)
            if gap.top1_changed is not None:
                summary[f"{out.name}.fused_vs_unfused.top1_changed"] = str(gap.top1_changed)
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
            what = "fused model, what deploys" if gate.model == "fused" else "unfused model: "
            what += "" if gate.model == "fused" else "there is no fused CPU variant"
            failure.text = f"FAIL ({what}): {gate.describe()}"
        ET.SubElement(case, "system-out").text = gate.describe()
    if result.warnings:
        text = "\n".join(f"warning: {w.message}" for w in result.warnings)
        ET.SubElement(suite, "system-err").text = text
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n"
