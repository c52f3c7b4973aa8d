"""The summary tests/gpu/run.sh prints last: what the GPU run proved and measured, read from the
files the run wrote (pytest's JUnit XML, benchmarks/gpu_observe.py's JSON, the QAT step's JSON),
so the end of the log holds every figure the note needs.

    python tests/gpu/summarize.py OUT_DIR [SECONDS]   # the summary
    cuobjdump -sass LIB | python tests/gpu/summarize.py --sass   # 16-byte loads per kernel

Missing files are reported as missing (a stage that failed or ran out of time), never skipped.
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

# test function -> what it proves, in the order printed
KERNELS = {
    "test_tensor_minmax": "min/max (tensor)",
    "test_tensor_minmax_signed_zeros": "min/max signed zeros",
    "test_tensor_minmax_all_nonfinite": "min/max all NaN",
    "test_channel_minmax": "min/max per channel",
    "test_histogram": "histogram",
    "test_observe": "observe (min/max + histogram)",
    "test_observe_activations": "observe on activations",
    "test_observer_stream_matches_the_cpu_observer": "observer stream (calibration)",
    "test_grid_size_does_not_change_results": "observe, grid sizes",
    "test_observe_on_device_at_every_alignment": "observe, misaligned pointers",
    "test_mse": "MSE errors + threshold",
    "test_kl": "KL divergences (tolerance)",
    "test_kl_sparse_histogram": "KL sparse (tolerance)",
    "test_block_mse_search_matches_cpu": "block MSE search",
    "test_quantize_blockwise_on_cuda_writes_the_cpu_weights": "int4 weights via CUDA",
    "test_one_qat_step_on_cuda_matches_the_cpu_step": "QAT step CUDA vs CPU",
    "test_deterministic_turns_tf32_off_and_restores_it": "QAT TF32 off",
    "test_nccl_calibration_writes_the_single_process_stats_file": "NCCL calibration",
    "test_nccl_qat_exports_the_model_it_trained": "NCCL QAT",
}


def tests_summary(junits: list[Path]) -> list[str]:
    missing = [f"tests: {j.name} missing (pytest did not finish)" for j in junits]
    missing = [m for m, j in zip(missing, junits, strict=True) if not j.is_file()]
    cases = [c for j in junits if j.is_file() for c in ET.parse(j).getroot().iter("testcase")]
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for case in cases:
        name = case.get("name", "").split("[")[0]
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        counts[name][outcome] += 1
    lines = [f"{'check':40s} passed failed skipped"]
    names = [n for n in KERNELS if n in counts] + sorted(set(counts) - set(KERNELS))
    for name in names:
        c = counts[name]
        label = KERNELS.get(name, name)
        lines.append(f"{label:40s} {c['passed']:6d} {c['failed']:6d} {c['skipped']:7d}")
    total = {o: sum(c[o] for c in counts.values()) for o in ("passed", "failed", "skipped")}
    lines.append(f"{'all GPU tests':40s} {total['passed']:6d} {total['failed']:6d} "
                 f"{total['skipped']:7d}")  # fmt: skip
    return missing + lines


def bench_summary(path: Path) -> list[str]:
    if not path.is_file():
        return [f"benchmark: {path.name} missing (the benchmark did not finish)"]
    data = json.loads(path.read_text())
    m = data["machine"]
    lines = [
        f"GPU {m['name']} ({m['multiprocessors']} SMs, {m['memory_gib']} GiB), driver "
        f"{m.get('driver')}, build {m['build'].get('compiler')} {m['build'].get('archs')}, "
        f"torch {m['torch']} (CUDA {m['torch_cuda']})",
        f"device-to-device copy: {data['copy']['gb_per_s']:.0f} GB/s (read + write), "
        f"tensor {data['elements'] * 4 / 2**30:.1f} GiB, {data['bins']} bins",
        f"{'variant':32s} " + " ".join(f"{d['kind']:>15s}" for d in data["distributions"]),
    ]
    variants = [r["variant"] for r in data["distributions"][0]["rows"]]
    for v in variants:
        cells = []
        for d in data["distributions"]:
            row = next(r for r in d["rows"] if r["variant"] == v)
            mark = {True: "", False: " !", None: ""}[row["bit_exact_vs_cpu"]]
            cells.append(f"{row['gb_per_s']:6.0f} {row['share_of_copy']:5.1%}{mark:2s}")
        lines.append(f"{v:32s} " + " ".join(f"{c:>15s}" for c in cells))
    best = data["fastest"]
    lines.append(
        f"fastest: {best['variant']} (blocks/SM {best['blocks_per_sm'] or 'auto'}), share of "
        f"copy bandwidth "
        + ", ".join(f"{k} {v:.1%}" for k, v in best["shares"].items())
        + f"; target {data['target_share_of_copy']:.0%}; built-in default "
        f"{data['default_variant']}; all designs bit-exact vs CPU: {data['all_bit_exact']}"
    )
    return lines


def qat_summary(path: Path) -> list[str]:
    if not path.is_file():
        return [f"QAT: {path.name} missing (the QAT test did not run)"]
    lines = []
    for case, d in json.loads(path.read_text()).items():
        lines.append(
            f"QAT step {case:26s} loss cpu {d['loss_a']:.7g} cuda {d['loss_b']:.7g} "
            f"(rel {d['loss_rel_diff']:.1e}); worst update rel {d['worst_update_rel_diff']:.1e}; "
            f"worst moved {d['worst_moved_rel_diff']:.1e}; logits differing "
            f"{d['logits_differing']}/{d['logits_total']} (max {d['logits_max_diff_steps']:.2f} "
            "steps)"
        )
    return lines


def sass_summary(text: str) -> list[str]:
    """Per fused observe kernel: 16-byte global loads and shared atomics in its sm_90 SASS."""
    lines = []
    for block in re.split(r"\n\s*Function : ", text)[1:]:
        name = block.split("\n", 1)[0].strip()
        if "observe" not in name and "block_mse" not in name:
            continue
        loads = len(re.findall(r"LDG\.E\.128", block))
        atoms = len(re.findall(r"\bATOMS\.", block))
        short = re.sub(r"_ZN\d+_GLOBAL__N__\w+?_cuda_cu_\w{8}\d+", "", name)[:90]
        lines.append(f"{short:90s} LDG.E.128 {loads:3d}  ATOMS {atoms:3d}")
    return lines or ["no observe kernels found in the SASS"]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--sass"]:
        print("\n".join(sass_summary(sys.stdin.read())))
        return 0
    out = Path(argv[0])
    parts = [
        tests_summary([out / "junit.xml", out / "junit_nccl.xml"]),
        bench_summary(out / "gpu_observe.json"),
        qat_summary(out / "qat_step.json"),
    ]
    if len(argv) > 1:
        parts.append([f"run.sh total: {argv[1]} s"])
    print("\n\n".join("\n".join(p) for p in parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
