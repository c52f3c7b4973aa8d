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
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from qtool import distributed, kernels
from qtool.app import settings
from qtool.app.common import statistics
from qtool.config.recipe import Recipe
from qtool.data.batches import iter_batches
from qtool.errors import RecipeError
from qtool.io import commit_files
from qtool.model.load import build_pytorch_module, check_inputs, export_module, fit_ir_version
from qtool.ort.cpu import resolve_cpu
from qtool.phases import phase
from qtool.pipeline import planning
from qtool.pipeline.build import Built
from qtool.pipeline.finish import Finished, verify_and_report, verify_feeds
from qtool.pipeline.float_model import (
    freeze,
    prepare_in_place,
    source_file_bytes,
    source_sha256,
)
from qtool.pipeline.prepare import Prepared
from qtool.qat import export
from qtool.qat.fold import fold_batchnorm
from qtool.qat.instrument import FakeQuantModel
from qtool.qat.mapping import activation_sites, check_sites, initializer_state
from qtool.qat.mapping import weight_parameters as map_weights
from qtool.qat.spec import QatSpec
from qtool.qat.stores import int8_compute_inputs, weight_stores
from qtool.qat.train import TrainingSet, deterministic, make_loss, train
from qtool.report import report_bytes
from qtool.write.assemble import (
    activation_parameters,
    bias_parameters,
    integer_kernel_weights,
    weight_parameters,
)
from qtool.write.matmul_nbits import nbits_level
from qtool.write.qdq import write_qdq_model

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
    if recipe.algorithms:
        names = ", ".join(recipe.algorithms.names())
        raise RecipeError(
            f"{recipe.path}: quantization.algorithms [{names}]: qtool qat trains the weights "
            "and biases itself and runs no PTQ algorithm; remove them from the QAT recipe"
        )
    quantization = recipe.quantization
    asked = quantization.precisions_asked() & {"fp8", "fp16", "bf16"}
    if asked or quantization.float_type != "fp32":
        what = ", ".join(sorted(asked)) or f"float_type {quantization.float_type}"
        raise RecipeError(
            f"{recipe.path}: quantization ({what}): qtool qat trains int8 and int4 fake "
            "quantization; FP8 and the FP16/BF16 typing are written by `qtool quantize`"
        )
    dynamic = [("quantization", quantization.activations)]
    dynamic += [(o.where, o.activations) for o in quantization.overrides]
    where = next((w for w, activations in dynamic if activations == "dynamic"), None)
    if where is not None:
        raise RecipeError(
            f"{recipe.path}: {where}.activations: qtool qat does not train dynamic INT8 yet "
            "(no fake quantization of run-time ranges); train with int8 and write the dynamic "
            "model with `qtool quantize`"
        )
    qat = recipe.qat or QatSpec()
    train = qat.data or recipe.calibration.data
    if train.text is not None:
        raise RecipeError(
            f"{recipe.path}: {train.where}.text: qtool qat does not train on text yet (its "
            "losses take one label per sample, not a next token per position); quantize the "
            "decoder with qtool quantize"
        )
    return qat


def _prepare(recipe: Recipe, net) -> Prepared:
    """The prepare stage for an already built (BN-folded) module: the same export, preparation
    and plan as `qtool quantize`, from the module instead of the recipe's factory."""
    where = str(recipe.path)
    loaded = export_module(net, recipe.model, recipe.inputs)
    check_inputs(loaded, recipe.inputs, str(recipe.model.pytorch))
    fit_ir_version(loaded, str(recipe.model.pytorch))
    min_opset = planning.min_opset(recipe.model.opset, recipe.quantization)
    size = source_file_bytes(recipe.model, loaded)
    model = prepare_in_place(loaded, min_opset, str(recipe.model.pytorch))
    del loaded
    frozen = freeze(model, recipe.float_model_path, source_sha256(recipe.model), size)
    del model
    frozen.materialize()  # training reads every weight (a staged model comes back lazy)
    layout = planning.plan(frozen.model, recipe.quantization, recipe.calibration.method, where)
    for node in layout.plan:
        if node.weight is not None and node.weight.method == "gptq":
            raise RecipeError(
                f"{where}: node '{node.name}': weight method gptq: QAT trains the weights; "
                "use minmax or mse in a QAT recipe"
            )
    return Prepared(frozen, layout)


def _stack(spec, recipe: Recipe, max_samples: int | None):
    """All samples of a data source in memory: (inputs by name, labels or None, batches)."""
    batches = list(iter_batches(spec, recipe.inputs, _STACK, max_samples, recipe.seed))
    names = [i.name for i in recipe.inputs]
    inputs = {n: np.concatenate([b.inputs[n] for b in batches]) for n in names}
    labels = None if batches[0].labels is None else np.concatenate([b.labels for b in batches])
    return inputs, labels, batches


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
    finished: Finished | None = None
    try:
        layout, model = prepared.layout, prepared.model.model
        calibration = statistics(recipe, prepared, stats_path, progress, group)
        stats = calibration.by_name()
        feeds = verify_feeds(settings.calibration_data(recipe))
        device = kernels.default_device()
        cpu = resolve_cpu(recipe.quantization.cpu)
        symmetric = recipe.quantization.symmetric_activations
        calibrated = activation_parameters(layout, stats, recipe.calibration, symmetric, device)
        names = [i.name for i in recipe.inputs]
        with phase("mapping the plan to the PyTorch modules"):
            sites = activation_sites(model, layout, names)
            ties = map_weights(model, layout, net)
            check_sites(net, model, sites, feeds[0])
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
        stores = weight_stores(layout, recipe.quantization.saturation, cpu, device, ties)
        nbits, nbits_reason = nbits_level(recipe.quantization, cpu)
        int8_inputs = int8_compute_inputs(model, layout, stores, ties, net, nbits)
        fake = FakeQuantModel(
            net,
            sites,
            calibrated,
            stores,
            qat.learn_scales,
            frozenset(ties[name].parameter for name in learned),
            int8_inputs,
        )

        with phase("reading the training data"):
            train_spec = qat.data or recipe.calibration.data
            max_samples = None if qat.data is not None else recipe.calibration.max_samples
            inputs, labels, _ = _stack(train_spec, recipe, max_samples)
            distill = labels is None or qat.loss is None
            if distill:
                size = len(inputs[names[0]])
                chunks = [
                    {n: inputs[n][i : i + _STACK] for n in names} for i in range(0, size, _STACK)
                ]
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
            check_feeds = eval_feeds or [
                b.inputs for b in _stack(train_spec, recipe, max_samples)[2]
            ]

        accuracy = {}
        if eval_labels is not None and group.primary:
            with phase("measuring accuracy before training"):
                fp32 = export.torch_outputs(teacher, eval_feeds, names)
                accuracy["fp32"] = export.accuracy(fp32, eval_labels)
                accuracy["fake_quant_before"] = export.accuracy(
                    export.torch_outputs(fake, eval_feeds, names), eval_labels
                )
        identity = {
            "float_model_sha256": prepared.model.fingerprint,
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
                trained_model,
                layout,
                activations,
                weights,
                biases,
                recipe.quantization.target,
                nbits,
            )
        node_inputs = {node.name: list(node.input) for node in model.graph.node}
        built = Built(
            quantized, layout, activations, weights, node_inputs, cpu, nbits, nbits_reason
        )
        files = {
            "float_model": str(recipe.float_model_path),
            "quantized_model": str(recipe.quant_model_path),
            "stats": str(calibration.path),
        }
        finished = verify_and_report(
            built,
            prepared.model,
            recipe.quant_model_path,
            settings.report_header(recipe),
            feeds,
            files,
            settings.settings_sha256(recipe),
            calibration.data_sha256,
        )
        source = finished.source
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
        report = finished.report
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
            {**calibration.files, **finished.files, recipe.report_path: report_bytes(report)}
        )
        group.barrier("waiting for rank 0 to write the QAT model")
        return QatResult(recipe.quant_model_path, recipe.report_path, report, finished.warnings)
    finally:  # neither staged model (float, quantized) outlives the run
        prepared.model.discard()
        if finished is not None:
            finished.discard()
