"""`qtool qat RECIPE`: the PTQ plan and ranges, trained with fake quantization, written by the
PTQ writer and verified as PTQ models are.

Stages: build the torch module and fold its BatchNorms -> export and prepare exactly as
`qtool quantize` does (same plan, same calibration, same ranges) -> map the Layout back to the
module and prove the mapping -> fake-quantize and train -> trained weights into the prepared
model, learned (or calibrated) scales into the writer's parameters -> write_qdq_model ->
verify (what ORT fuses) -> equivalence of ORT and the fake-quant module on real data -> report.

Under torchrun every rank runs the stages up to training (calibrating its shard of the
batches, merged exactly), trains data-parallel (train.py), and rank 0 alone exports, verifies
and writes while the others wait at a barrier: after DDP's all-reduce every rank holds the
same weights, so one export is the model.
"""

from __future__ import annotations

import copy
import hashlib
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx
import torch

from qtool import distributed, kernels
from qtool.app.pipeline import (
    PreparedModel,
    source_sha256,
    stamp_provenance,
    statistics,
    verify_feeds,
)
from qtool.config.recipe import Recipe
from qtool.data.batches import iter_batches
from qtool.errors import ModelError, RecipeError
from qtool.io import commit_files
from qtool.model.load import build_pytorch_module, check_inputs, export_module, fit_ir_version
from qtool.model.opset21 import TARGET_OPSET
from qtool.model.prepare import prepare_model, tensor_types
from qtool.ort.cpu import resolve_cpu
from qtool.ort.sessions import create_session
from qtool.phases import phase
from qtool.plan.layout import plan_layout
from qtool.qat import export
from qtool.qat.fold import fold_batchnorm
from qtool.qat.instrument import FakeQuantModel
from qtool.qat.mapping import WeightTie, activation_sites, check_sites, initializer_state
from qtool.qat.mapping import weight_parameters as map_weights
from qtool.qat.spec import QatSpec
from qtool.qat.train import TrainingSet, deterministic, make_loss, train
from qtool.report import build_report, report_bytes
from qtool.runtime.verify import verify
from qtool.write.assemble import (
    activation_parameters,
    bias_parameters,
    integer_kernel_weights,
    weight_parameters,
)
from qtool.write.int4 import BlockwiseWeight
from qtool.write.low_bit import quantize_low_bit
from qtool.write.matmul_nbits import nbits_level
from qtool.write.qdq import nbits_readers, write_qdq_model
from qtool.write.weight_format import choose_weight

_STACK = 256  # samples per chunk when the training / evaluation set is read into memory


@dataclass
class QatResult:
    model_path: Path
    report_path: Path
    report: dict
    warnings: list[str] = field(default_factory=list)


def _check_recipe(recipe: Recipe) -> QatSpec:
    if recipe.model.pytorch is None:
        raise RecipeError(
            f"{recipe.path}: model.onnx: qtool qat trains PyTorch models; give model.pytorch "
            "(file.py:factory) and model.weights"
        )
    if recipe.quantization.algorithms:
        names = ", ".join(name for name, _ in recipe.quantization.algorithms)
        raise RecipeError(
            f"{recipe.path}: quantization.algorithms [{names}]: qtool qat trains the weights "
            "and biases itself and runs no PTQ algorithm; remove them from the QAT recipe"
        )
    return recipe.qat or QatSpec()


def _prepare(recipe: Recipe, net) -> PreparedModel:
    """pipeline.prepare for an already built (BN-folded) module: the same export and stages."""
    loaded = export_module(net, recipe.model, recipe.inputs)
    check_inputs(loaded, recipe.inputs, str(recipe.model.pytorch))
    fit_ir_version(loaded, str(recipe.model.pytorch))
    min_opset = recipe.model.opset
    if recipe.quantization.may_need_opset21:
        min_opset = max(min_opset, TARGET_OPSET)
    with phase("preparing graph"):
        model = prepare_model(loaded, min_opset=min_opset, copy=False)
    float_tensors = {
        name for name, (elem, _) in tensor_types(model).items() if elem == onnx.TensorProto.FLOAT
    }
    layout = plan_layout(
        model, recipe.quantization, float_tensors, recipe.calibration.method, str(recipe.path)
    )
    if not layout.quantized_nodes():
        raise ModelError(f"{recipe.path}: no node can be quantized with this recipe")
    for node in layout.plan:
        if node.weight is not None and node.weight.method == "gptq":
            raise RecipeError(
                f"{recipe.path}: node '{node.name}': weight method gptq: QAT trains the weights; "
                "use minmax or mse in a QAT recipe"
            )
    serialized = model.SerializeToString()
    fingerprint = hashlib.sha256(serialized).hexdigest()
    return PreparedModel(
        onnx.load_from_string(serialized), serialized, fingerprint, layout, source_sha256(recipe)
    )


def _stack(spec, recipe: Recipe, max_samples: int | None):
    """All samples of a data source in memory: (inputs by name, labels or None, batches)."""
    batches = list(iter_batches(spec, recipe.inputs, _STACK, max_samples, recipe.seed))
    names = [i.name for i in recipe.inputs]
    inputs = {n: np.concatenate([b.inputs[n] for b in batches]) for n in names}
    labels = None if batches[0].labels is None else np.concatenate([b.labels for b in batches])
    return inputs, labels, batches


def _weight_stores(
    prepared: PreparedModel, recipe: Recipe, cpu, device: str, ties: dict[str, WeightTie]
) -> dict:
    """Parameter name -> (its float value -> the writer's stored form, transposed?), per weight
    the same function weight_parameters calls. A transposed tie stores the parameter's
    transpose, the initializer's layout, and reads it back transposed."""
    layout = prepared.layout
    integer = integer_kernel_weights(layout)
    plans = layout.plan.weight_plans()
    spec = recipe.quantization
    stores = {}
    for name, slot in layout.weights.items():
        plan, tie = plans[name], ties[name]
        if name in integer:

            def store(w, slot=slot, plan=plan, flip=tie.transposed):
                w = np.ascontiguousarray(w.T) if flip else w
                return choose_weight(w, slot, plan, cpu, spec.saturation, device)
        else:

            def store(w, slot=slot, plan=plan, flip=tie.transposed):
                return quantize_low_bit(np.ascontiguousarray(w.T) if flip else w, slot, plan)

        stores[tie.parameter] = (store, slot.transposed != tie.transposed)
    return stores


# MatMulNBits' accuracy level that quantizes the kernel's float input to int8 (ORT 1.31)
INT8_COMPUTE_LEVEL = 4


def _int8_compute_inputs(
    model: onnx.ModelProto,
    layout,
    stores: dict,
    ties: dict[str, WeightTie],
    net: torch.nn.Module,
    level: int | None,
) -> dict[str, int]:
    """Module path -> block size of every 4-bit weight the writer will emit as MatMulNBits with
    int8 compute: the module's input must be fake-quantized as the kernel quantizes it, or the
    deployed model is not the one that trained (measured: 1.07 output steps apart, digits-like
    rows model, AVX-512 VNNI). Level 1 (fp32 compute) and QDQ-format weights need nothing."""
    if level != INT8_COMPUTE_LEVEL:
        return {}
    plans = layout.plan.weight_plans()
    low_bit = {}
    for name, tie in ties.items():
        if plans[name].bits != 4:
            continue
        store, _ = stores[tie.parameter]
        stored = store(net.get_parameter(tie.parameter).detach().cpu().numpy())
        if isinstance(stored, BlockwiseWeight):
            low_bit[name] = stored
    transposed = {name for name, slot in layout.weights.items() if slot.transposed}
    inputs = {}
    for name, node in sorted(nbits_readers(model.graph, low_bit, transposed).items()):
        path = ties[name].parameter.rpartition(".")[0]
        if not isinstance(net.get_submodule(path), torch.nn.Linear):
            raise ModelError(
                f"node '{node}': its 4-bit weight is written as MatMulNBits with int8 compute, "
                f"which quantizes the node's input; qtool qat emulates that only for nn.Linear, "
                f"and '{path}' is {type(net.get_submodule(path)).__name__} (set "
                "quantization.accuracy_level: 1 for fp32 compute)"
            )
        inputs[path] = int(low_bit[name].block_size)
    return inputs


def run_qat(
    recipe: Recipe,
    resume: bool = False,
    progress: bool = True,
    stats_path: Path | None = None,
) -> QatResult | None:
    """Train the recipe's PyTorch model with fake quantization and export it (see top).

    `stats_path`: ranges from that stats file (as `qtool quantize --stats`) instead of a
    calibration run. Under torchrun every rank calibrates its shard (merged exactly) and trains
    on its part of each batch (DDP); rank 0 alone writes and returns the result, the others
    wait for it at a barrier and return None.
    """
    group = distributed.current()
    qat = _check_recipe(recipe)
    seed = recipe.seed if qat.seed is None else qat.seed

    with phase("building the PyTorch model"):
        net = build_pytorch_module(recipe.model)
        folded = fold_batchnorm(net)
        net.eval()
        teacher = copy.deepcopy(net)
    prepared = _prepare(recipe, net)
    layout, model = prepared.layout, prepared.model
    calibration, stats_path = statistics(recipe, prepared, stats_path, progress, group)
    stats = {s.name: s for s in calibration.stats}
    device = kernels.default_device()
    cpu = resolve_cpu(recipe.quantization.cpu)
    symmetric = recipe.quantization.symmetric_activations
    calibrated = activation_parameters(layout, stats, recipe.calibration, symmetric, device)
    names = [i.name for i in recipe.inputs]
    with phase("mapping the plan to the PyTorch modules"):
        sites = activation_sites(model, layout, names)
        ties = map_weights(model, layout, net)
        check_sites(net, model, sites, verify_feeds(recipe)[0])
    initializers = {init.name for init in model.graph.initializer}
    plain = {n: p.detach().numpy() for n, p in net.named_parameters()}
    _, unused = initializer_state(plain, ties, initializers)
    for name in unused:  # not in the exported graph: no gradient, nothing to export
        net.get_parameter(name).requires_grad_(False)
    # LSQ weight scales only where no integer kernel multiplies the weight: an int8 kernel
    # weight keeps the writer's format (pair-safe where 16-bit pair sums could saturate).
    learned = frozenset()
    if qat.learn_scales:
        learned = frozenset(layout.weights) - integer_kernel_weights(layout)
    stores = _weight_stores(prepared, recipe, cpu, device, ties)
    nbits, nbits_reason = nbits_level(recipe.quantization, cpu)
    int8_inputs = _int8_compute_inputs(model, layout, stores, ties, net, nbits)
    fake = FakeQuantModel(
        net,
        sites,
        calibrated,
        stores,
        qat.learn_scales,
        frozenset(ties[name].parameter for name in learned),
        int8_inputs,
    )

    train_spec = qat.data or recipe.calibration.data
    max_samples = None if qat.data is not None else recipe.calibration.max_samples
    inputs, labels, _ = _stack(train_spec, recipe, max_samples)
    distill = labels is None or qat.loss is None
    if distill:
        size = len(inputs[names[0]])
        chunks = [{n: inputs[n][i : i + _STACK] for n in names} for i in range(0, size, _STACK)]
        outs = export.torch_outputs(teacher, chunks, names)
        targets = [np.concatenate([c[k] for c in outs]) for k in range(len(outs[0]))]
    else:
        targets = labels
    data = TrainingSet(inputs, targets, distill)
    loss_fn, loss_name = make_loss(qat.loss, distill)

    evaluation = recipe.evaluation
    eval_feeds, eval_labels = None, None
    if evaluation is not None:
        batches = list(iter_batches(evaluation.data, recipe.inputs, evaluation.batch_size))
        eval_feeds = [b.inputs for b in batches]
        if batches[0].labels is not None:
            eval_labels = [b.labels for b in batches]
    check_feeds = eval_feeds or [b.inputs for b in _stack(train_spec, recipe, max_samples)[2]]

    accuracy = {}
    if eval_labels is not None and group.primary:
        fp32 = export.torch_outputs(teacher, eval_feeds, names)
        accuracy["fp32"] = export.accuracy(fp32, eval_labels)
        accuracy["fake_quant_before"] = export.accuracy(
            export.torch_outputs(fake, eval_feeds, names), eval_labels
        )
    identity = {
        "float_model_sha256": prepared.fingerprint,
        "calibration_data_sha256": calibration.data_sha256 or "none",
        "qat": repr(replace(qat, epochs=0)),  # more epochs may follow a resume
        "seed": seed,
        "processes": group.world,  # the global batch is batch_size x processes
    }
    started, cpu_started = time.perf_counter(), time.process_time()
    with deterministic(seed):
        history = train(
            fake,
            data,
            loss_fn,
            epochs=qat.epochs,
            lr=qat.lr,
            optimizer_name=qat.optimizer,
            batch_size=qat.batch_size,
            seed=seed,
            output_dir=recipe.output_dir,
            identity=identity,
            resume=resume,
            progress=progress,
            group=group,
        )
    train_seconds = time.perf_counter() - started
    train_cpu_seconds = time.process_time() - cpu_started
    if not group.primary:
        group.barrier("waiting for rank 0 to write the QAT model")
        return None

    with phase("writing the QAT model"):
        trained, _ = initializer_state(fake.float_state(), ties, initializers)
        trained_model = export.with_trained_weights(model, trained)
        activations = fake.activation_params()
        weights = weight_parameters(trained_model, layout, recipe.quantization, cpu, device)
        by_parameter = {tie.parameter: name for name, tie in ties.items()}
        weights.update({by_parameter[p]: w for p, w in fake.learned_weights().items()})
        plans = layout.plan.weight_plans()
        for name in learned:
            plans[name].reason += " (scales learned by QAT, LSQ)"
        biases = bias_parameters(trained_model, layout, activations, weights)
        quantized = write_qdq_model(
            trained_model, layout, activations, weights, biases, recipe.quantization.target, nbits
        )
        stamp_provenance(quantized, recipe, prepared, calibration)
        source = quantized.SerializeToString()
    try:
        create_session(source)
    except Exception as exc:
        raise ModelError(f"the QAT model does not load in ONNX Runtime: {exc}") from None
    with phase("verifying what ONNX Runtime runs"):
        verification = verify(
            source,
            layout.plan,
            verify_feeds(recipe),
            cpu,
            target=recipe.quantization.target,
            float_model=prepared.serialized,
        )
    with phase("checking the export against the fake-quant model"):
        reference = export.torch_outputs(fake, check_feeds, names)
        unfused = export.ort_outputs(source, check_feeds, fused=False)
        fused = export.ort_outputs(source, check_feeds, fused=True)
    equivalence = {
        "data": "evaluation" if eval_feeds else "training",
        "samples": int(sum(len(next(iter(f.values()))) for f in check_feeds)),
        "output_step": export.output_step(reference),
        "max_abs_diff_unfused": export.max_difference(reference, unfused),
        "max_abs_diff_fused": export.max_difference(reference, fused),
    }
    if eval_labels is not None:
        accuracy["fake_quant_after"] = export.accuracy(reference, eval_labels)
        accuracy["exported_unfused"] = export.accuracy(unfused, eval_labels)
        accuracy["exported_fused"] = export.accuracy(fused, eval_labels)
    files = {
        "float_model": str(recipe.float_model_path),
        "quantized_model": str(recipe.quant_model_path),
        "stats": str(stats_path),
    }
    node_inputs = {node.name: list(node.input) for node in model.graph.node}
    report = build_report(
        recipe, node_inputs, layout, activations, weights, files, cpu, verification.summary
    )
    report["int4_matmul"] = {
        "format": recipe.quantization.resolved_int4_format,
        "accuracy_level": nbits,
        "why": nbits_reason,
    }
    report["qat"] = {
        "epochs": history.epochs_done,
        "resumed_after_epoch": history.resumed_from,
        "loss": loss_name,
        "epoch_losses": history.losses,
        "final_loss": history.losses[-1] if history.losses else None,
        "optimizer": qat.optimizer,
        "lr": qat.lr,
        "batch_size": qat.batch_size,
        "seed": seed,
        "training_samples": len(data),
        "learn_scales": qat.learn_scales,
        "learned_weight_scales": sorted(learned),
        "batchnorm_folded": [{"conv": c, "batchnorm": b} for c, b in folded],
        "fake_quant_tensors": len(sites),
        "frozen_unused_parameters": unused,
        "fake_quant_weights": len(layout.weights),
        # inputs quantized per block as MatMulNBits' int8 compute (accuracy level 4) does
        "int8_compute_inputs": sorted(int8_inputs),
        "processes": group.world,
        "global_batch_size": qat.batch_size * group.world,
        "train_seconds": round(train_seconds, 3),
        "train_cpu_seconds_rank0": round(train_cpu_seconds, 3),
        "accuracy": accuracy,
        "equivalence": equivalence,
        "activation_scales_changed": sum(
            1 for t in activations if activations[t].scale != calibrated[t].scale
        ),
    }
    commit_files(
        {
            **calibration.files,
            recipe.quant_model_path: source,
            recipe.report_path: report_bytes(report),
        }
    )
    group.barrier("waiting for rank 0 to write the QAT model")
    return QatResult(recipe.quant_model_path, recipe.report_path, report, verification.warnings)
