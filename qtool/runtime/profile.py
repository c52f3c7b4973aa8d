"""Per-node latency from ONNX Runtime's profiler, attributed to the nodes of a plan.

The latency objective of mixed precision needs each planned node's time at each precision, on
this machine, as ORT really runs it. A formula cannot know that a 4-bit MatMul runs on
MatMulNBits while a 4-bit Conv runs dequantized, or that a uint8 Conv is slower than float on a
CPU without VNNI, so the time is measured: the model is run `runs` times under ORT's profiler
(`SessionOptions.enable_profiling`, one `Node` event per kernel per run, `dur` in
microseconds), with one intra-op thread (the machine may be shared: parallel kernels would time
the neighbours) and the median per ORT node over the runs.

ORT runs an optimized graph, whose node names are not the written model's. Each ORT node is
given to one owner:

1. the planned node that `fusion.locate` maps it to (QLinearConv / QGemm / MatMulNBits /
   FusedConv keep the node's name or read its weights; see qtool/runtime/fusion.py); an ORT node
   several planned nodes map to is split evenly between them;
2. a node that keeps the name of a written node not in the plan (Softmax, LayerNormalization)
   is "other": its time does not depend on the plan;
3. a QuantizeLinear, DequantizeLinear or layout node (the Transposes and reorders of the NHWC
   and NCHWc layouts) belongs to the planned nodes it feeds, following its outputs through
   other such nodes (the Q before a QLinearConv, the DQ of a weight that stayed unfused); where
   it feeds no planned node, to the planned node it reads from (the DQ that turns an int8
   output back to float for a Softmax); else "other". Several owners found at the same step
   share it evenly;
4. any other node ORT generated (SkipLayerNormalization from an Add and a LayerNorm) is
   "other".

So a node's int8 time includes quantizing its inputs and dequantizing its outputs for float
consumers: what turning that one node to int8 costs, which is what the knapsack adds up.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime

from qtool.errors import ModelError
from qtool.ort.sessions import CPU_PROVIDER, ort_reason, session_options
from qtool.runtime.fusion import Located, locate

OTHER = "(other)"
_WARMUP_RUNS = 3
_FOLLOW = frozenset(
    {"QuantizeLinear", "DequantizeLinear", "Transpose", "ReorderInput", "ReorderOutput"}
)


@dataclass
class NodeTimes:
    """Median microseconds per run: per planned node, the rest, and what could not be named."""

    nodes: dict[str, float]  # planned node -> us
    other_us: float
    total_us: float  # sum over every profiled kernel (median per kernel)
    runs: int
    threads: int
    ort_nodes: dict[str, dict] = field(default_factory=dict)  # ORT node -> {op, us, owners}

    def to_dict(self) -> dict:
        return {
            "runs": self.runs,
            "threads": self.threads,
            "total_us": round(self.total_us, 2),
            "other_us": round(self.other_us, 2),
            "nodes_us": {k: round(v, 2) for k, v in self.nodes.items()},
        }


def kernel_times(
    model: bytes, feed: Mapping[str, np.ndarray], runs: int, threads: int = 1
) -> dict[str, tuple[str, float]]:
    """ORT node name -> (op type, median us per run) from `runs` profiled runs of `model`
    (after a few unprofiled-in-the-result warm-up runs)."""
    options = session_options(threads, optimize=True)
    with tempfile.TemporaryDirectory(prefix="qtool-profile-") as folder:
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(folder) / "ort")
        try:
            session = onnxruntime.InferenceSession(
                model, sess_options=options, providers=[CPU_PROVIDER]
            )
        except Exception as exc:  # ORT raises several private exception types
            raise ModelError(
                f"ONNX Runtime cannot load <in-memory model>: {ort_reason(exc)}"
            ) from exc
        for _ in range(_WARMUP_RUNS + runs):
            session.run(None, dict(feed))
        events = json.loads(Path(session.end_profiling()).read_text())
    per_run: dict[str, list[list[float]]] = {}
    ops: dict[str, str] = {}
    run = -1
    for event in events:
        if event.get("cat") == "Session" and event.get("name") == "model_run":
            continue
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
            continue
        name = event["name"][: -len("_kernel_time")]
        args = event.get("args", {})
        ops[name] = args.get("op_name", "")
        durations = per_run.setdefault(name, [])
        # A node's event count is runs x its calls per run; a new run starts when the first
        # node seen comes round again.
        if name == next(iter(per_run)):
            run += 1
        while len(durations) <= run:
            durations.append([])
        durations[run].append(float(event["dur"]))
    times = {}
    for name, by_run in per_run.items():
        sums = [sum(d) for d in by_run[_WARMUP_RUNS:]]
        times[name] = (ops[name], float(np.median(sums)) if sums else 0.0)
    return times


def _float_fallback(name: str, located: Located) -> onnx.NodeProto | None:
    """The ORT node of a planned node `fusion.locate` did not find: in a float model there are
    no quantized weights to follow, the NCHWc transform renames a Conv after the tensor it
    writes (`/relu1/Relu_output_0_nchwc` when a Relu was fused into it) and reorders its weight,
    and MatMulScaleFusion names a FusedMatMul `<name>/MatMulScaleFusion/` and writes the output
    of the Mul it absorbed. So the node is found by a constant input only it reads (its bias),
    else by a name derived from its own, else as the writer of its output (or of its single
    consumer's output)."""
    qdq, ort = located.qdq, located.ort
    node = located.planned[name]
    own = [
        t
        for t in node.input
        if t in qdq.initializers and len({id(c) for c in qdq.consumers.get(t, [])}) == 1
    ]
    for candidate in ort.nodes:
        if candidate.op_type not in _FOLLOW and any(t in candidate.input for t in own):
            return candidate
    for candidate in ort.nodes:
        if candidate.name.startswith(name + "/") and candidate.op_type not in _FOLLOW:
            return candidate
    written = list(node.output)
    for out in node.output:
        consumers = qdq.consumers.get(out, [])
        if len(consumers) == 1:  # an activation or scale ORT fuses into the node
            written.extend(consumers[0].output)
    for tensor in written:
        found = ort.by_name.get(f"{tensor}_nchwc")
        if found:
            return found[0]
    for tensor in written:
        producer = ort.producer.get(tensor)
        if producer is not None and producer.op_type not in _FOLLOW:
            return producer
    return None


def _owners(located: Located) -> dict[str, list[str]]:
    """ORT node name -> the planned nodes (or OTHER) its time belongs to (module docstring)."""
    ort = located.ort
    owners: dict[str, list[str]] = {}
    for name, node in located.found.items():
        node = node if node is not None else _float_fallback(name, located)
        if node is not None:
            owners.setdefault(node.name, []).append(name)
    qdq = located.qdq
    written = {n.name for n in qdq.nodes if n.name} - set(located.planned)
    for node in ort.nodes:
        if node.name not in owners and node.op_type not in _FOLLOW:
            base = node.name.split("_token_")[0].removeprefix("fused ")
            producer = qdq.producer.get(base.removesuffix("_nchwc"))  # NCHWc: named by output
            if base in written or (producer is not None and producer.name in written):
                owners[node.name] = [OTHER]

    def planned_only(names: list[str]) -> list[str]:
        return [n for n in names if n != OTHER]

    def walk(node: onnx.NodeProto, downstream: bool) -> list[str]:
        """Owners of the nearest owned nodes along outputs (or inputs), breadth first."""
        frontier, seen = [node], {id(node)}
        for _ in range(16):
            found: list[str] = []
            following = []
            for current in frontier:
                if downstream:
                    nxt = [c for out in current.output for c in ort.consumers.get(out, [])]
                else:
                    nxt = [ort.producer[i] for i in current.input if i in ort.producer]
                for other in nxt:
                    if id(other) in seen:
                        continue
                    seen.add(id(other))
                    if other.name in owners and other.op_type not in _FOLLOW:
                        found.extend(owners[other.name])
                    elif other.op_type in _FOLLOW:
                        following.append(other)
            mine = planned_only(found)
            if mine:
                return sorted(set(mine))
            if not following:
                return []
            frontier = following
        return []

    for node in ort.nodes:
        if node.name in owners:
            continue
        # Only the Q/DQ and layout nodes around a planned node are its cost; a node ORT
        # generated for other work (SkipLayerNormalization from an Add and a LayerNorm) is not.
        if node.op_type not in _FOLLOW:
            owners[node.name] = [OTHER]
            continue
        owners[node.name] = walk(node, True) or walk(node, False) or [OTHER]
    return owners


def node_times(
    model: bytes,
    planned: Mapping[str, str],
    feed: Mapping[str, np.ndarray],
    runs: int,
    threads: int = 1,
) -> NodeTimes:
    """Median us per run of each planned node (name -> op type in `model`) in `model`."""
    located = locate(model, dict(planned), threads)
    owners = _owners(located)
    kernels = kernel_times(model, feed, runs, threads)
    nodes = dict.fromkeys(planned, 0.0)
    other = 0.0
    detail = {}
    for name, (op, us) in kernels.items():
        # A kernel ORT profiled under a name its saved graph does not have is counted, not lost.
        share = owners.get(name, [OTHER])
        detail[name] = {"op": op, "us": us, "owners": share}
        for owner in share:
            if owner == OTHER:
                other += us / len(share)
            else:
                nodes[owner] += us / len(share)
    total = sum(us for _, us in kernels.values())
    return NodeTimes(nodes, other, total, runs, threads, detail)
