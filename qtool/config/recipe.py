"""Recipe: the YAML file that says what to quantize and how, validated into typed objects.

Validation happens once, up front, so a typo in the recipe fails in the first second with the key
path at fault (``calibration.method``) rather than after minutes of calibration. Unknown keys are
errors because a misspelt optional key would otherwise be silently ignored.

Only the orchestrators (qtool/app) read a Recipe: each stage below them receives the typed
section it needs (DataSpec, QuantizationSpec, CalibrationSpec, ...), defined in that stage's own
package, so no stage depends on the recipe's shape.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from qtool.algorithms.spec import (
    ALGORITHM_ORDER,
    ALGORITHM_PARAMS,
    MAX_ADAROUND_ITERATIONS,
    MAX_AWQ_GRID,
    MAX_SCALE_STEPS,
    SMOOTHQUANT_OBJECTIVES,
    AlgorithmParams,
    Algorithms,
    defaults,
)
from qtool.calibration.spec import MAX_BINS, METHODS, MIN_BINS, CalibrationSpec
from qtool.config import presets
from qtool.config.yaml_load import load_yaml
from qtool.data.spec import (
    IMAGE_MODES,
    INPUT_DTYPES,
    DataSpec,
    ImageFolder,
    InputSpec,
    TextSource,
)
from qtool.data.text import inputs_problem, tokenizer_file
from qtool.errors import RecipeError
from qtool.io import not_a_file
from qtool.metrics.spec import GATE_METRICS, EvaluationSpec, gate_problem, rows_problem
from qtool.model.spec import ModelSpec
from qtool.ort.cpu import CPU_NAMES
from qtool.pipeline.outputs import OutputFiles
from qtool.pipeline.tuning import BASELINES, MAX_EVERY, TuningSpec
from qtool.plan.attention import ROLES
from qtool.plan.ops import quantizable_op_types
from qtool.plan.settings import (
    ACCURACY_LEVEL_CHOICES,
    ACTIVATION_PRECISIONS,
    BLOCK_SIZES,
    DEFAULT_OP_TYPES,
    DYNAMIC_RANGES,
    DYNAMIC_TARGETS,
    FLOAT_IO,
    FLOAT_TYPES,
    INT4_FORMATS,
    PRECISIONS,
    QUANTIZED_PRECISIONS,
    SATURATION_POLICIES,
    TARGET_PRECISIONS,
    TARGETS,
    WEIGHT_GRANULARITIES,
    WEIGHT_METHODS,
    Override,
    QuantizationSpec,
    WeightSettings,
)
from qtool.qat.spec import QAT_LOSSES, QAT_OPTIMIZERS, QatSpec
from qtool.search.spec import MIXED_METRICS, MIXED_OBJECTIVES, BudgetSpec, MixedPrecisionSpec

T = TypeVar("T")

# No integer setting means anything above this; larger values (2**40 bins, a 1e30 batch) would
# only fail later as a MemoryError or an int64 overflow inside numpy or ONNX Runtime.
MAX_INTEGER = 2**31 - 1


@dataclass(frozen=True)
class Recipe:
    path: Path
    model: ModelSpec
    inputs: tuple[InputSpec, ...]
    calibration: CalibrationSpec
    quantization: QuantizationSpec = field(default_factory=QuantizationSpec)
    evaluation: EvaluationSpec | None = None
    output_dir: Path = Path("out")
    seed: int = 0
    mixed_precision: MixedPrecisionSpec | None = None
    qat: QatSpec | None = None
    # `quantization.algorithms` in the file; its own type: no stage below the build needs it
    algorithms: Algorithms = field(default_factory=Algorithms)
    # `tuning:`: the rows data-driven choices are scored on (qtool/pipeline/tuning.py)
    tuning: TuningSpec = field(default_factory=TuningSpec)
    # `output.float_model`: `auto` writes model.fp32.onnx unless the prepared model is over
    # protobuf's limit (then its weights live in a temporary file only while the command runs);
    # `always` writes it (and its .data) whatever its size.
    float_model: str = "auto"

    @property
    def outputs(self) -> OutputFiles:
        """The files of the output folder by role, named as every stage names them."""
        return OutputFiles(self.output_dir)

    @property
    def float_model_path(self) -> Path:
        return self.outputs.float_model

    @property
    def quant_model_path(self) -> Path:
        """model.int8.onnx, model.int4.onnx when the recipe asks for 4-bit weights anywhere,
        model.fp8.onnx for FP8 Q/DQ, model.fp16.onnx for a recipe that only types the model."""
        return self.outputs.quantized_model(self.quantization.model_tag)

    @property
    def stats_path(self) -> Path:
        return self.outputs.stats

    @property
    def hessians_path(self) -> Path:
        return self.outputs.hessians

    @property
    def report_path(self) -> Path:
        return self.outputs.report


FLOAT_MODEL_CHOICES = ("auto", "always")
_SHOW = reprlib.Repr()  # keyword arguments need Python 3.12
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother, _SHOW.maxlist, _SHOW.maxdict = 2, 60, 60, 4, 4
_SHOW.maxlong = 40


def _show(value: Any) -> str:
    """A bounded repr for error messages: a wrong value may be a huge nested structure, and an
    error must stay one short line."""
    return _SHOW.repr(value)


class _Reader:
    """Reads typed values out of nested YAML mappings, naming the key path in every error."""

    def __init__(self, recipe_path: Path) -> None:
        self.recipe_path = recipe_path
        self.base = recipe_path.parent

    def fail(self, where: str, message: str) -> RecipeError:
        return RecipeError(_one_line(f"{self.recipe_path}: {where}: {message}"))

    def probe(self, path: Path, where: str, query: Callable[[Path], T]) -> T:
        """`query(path)` (Path.is_file, Path.resolve, ...), with a path the OS refuses (a name
        over 255 bytes, a NUL byte) reported at `where` instead of raising OSError/ValueError."""
        try:
            return query(path)
        except (OSError, ValueError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            raise self.fail(where, f"not a usable path ({reason}): {_show(str(path))}") from None

    def mapping(self, value: Any, where: str, allowed: set[str], required: set[str] = frozenset()):
        if not isinstance(value, dict):
            raise self.fail(where, f"must be a mapping, got {type(value).__name__}")
        for key in value:
            if key not in allowed:
                options = ", ".join(sorted(allowed))
                raise self.fail(_join(where, str(key)), f"unknown key (allowed: {options})")
        for key in sorted(required):
            if key not in value:
                raise self.fail(_join(where, key), "is required")
        return value

    def integer(
        self, value: Any, where: str, minimum: int | None = None, maximum: int = MAX_INTEGER
    ) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(where, f"must be an integer, got {_show(value)}")
        if minimum is not None and value < minimum:
            raise self.fail(where, f"must be >= {minimum}, got {_show(value)}")
        if value > maximum:
            raise self.fail(where, f"must be <= {maximum}, got {_show(value)}")
        return value

    def number(self, value: Any, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(where, f"must be a number, got {_show(value)}")
        return float(value)

    def boolean(self, value: Any, where: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(where, f"must be true or false, got {_show(value)}")
        return value

    def string(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(where, f"must be a non-empty string, got {_show(value)}")
        return value

    def choice(self, value: Any, where: str, options: tuple[str, ...]) -> str:
        if value not in options:
            raise self.fail(where, f"must be one of {', '.join(options)}, got {_show(value)}")
        return value

    def existing_file(self, value: Any, where: str) -> Path:
        path = self.base / self.string(value, where)
        problem = self.probe(path, where, not_a_file)
        if problem is not None:
            raise self.fail(where, f"{problem}: {path}")
        return path

    def existing_dir(self, value: Any, where: str) -> Path:
        path = self.base / self.string(value, where)
        if not self.probe(path, where, Path.is_dir):
            raise self.fail(where, f"folder not found: {path}")
        return path

    def entry_point(self, value: Any, where: str) -> str:
        text = self.string(value, where)
        file_part, sep, func = text.rpartition(":")
        if not sep or not file_part.endswith(".py") or not func.isidentifier():
            raise self.fail(where, f"must look like 'file.py:function', got {_show(text)}")
        path = self.existing_file(file_part, where)
        return f"{path}:{func}"

    def string_list(self, value: Any, where: str) -> tuple[str, ...]:
        if not isinstance(value, list):
            raise self.fail(where, f"must be a list of strings, got {_show(value)}")
        return tuple(self.string(item, f"{where}[{i}]") for i, item in enumerate(value))

    def number_list(self, value: Any, where: str) -> tuple[float, ...]:
        if not isinstance(value, list):
            raise self.fail(where, f"must be a list of numbers, got {_show(value)}")
        return tuple(self.number(item, f"{where}[{i}]") for i, item in enumerate(value))

    def shape(self, value: Any, where: str, empty_axes: bool = False) -> tuple[int, ...]:
        """A list of dims, each >= 1; with `empty_axes`, dims after the first (the batch) may
        be 0: an empty axis, such as the past length of a KV-cache input fed no past."""
        if not isinstance(value, list) or not value:
            raise self.fail(
                where, f"must be a non-empty list of positive integers, got {_show(value)}"
            )
        return tuple(
            self.integer(dim, f"{where}[{i}]", minimum=0 if empty_axes and i > 0 else 1)
            for i, dim in enumerate(value)
        )


def _one_line(text: str) -> str:
    """Errors quote what the user wrote (keys, paths); a newline or other control character in
    it would break the one-line message, so such characters are shown escaped."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def load_recipe(path: str | Path, output_dir: str | Path | None = None) -> Recipe:
    """Parse and validate a recipe file; every problem is a RecipeError naming the key path."""
    recipe_path = Path(path)
    problem = not_a_file(recipe_path, "recipe file")
    if problem is not None:
        raise RecipeError(f"{recipe_path}: {problem}")
    raw = load_yaml(recipe_path)
    reader = _Reader(recipe_path)
    raw = _apply_base(reader, raw if raw is not None else {}, [recipe_path.resolve()])
    top = reader.mapping(
        raw,
        "",
        {
            "seed",
            "model",
            "inputs",
            "calibration",
            "quantization",
            "evaluation",
            "output",
            "mixed_precision",
            "qat",
            "tuning",
        },
        {"model", "inputs", "calibration"},
    )
    model = _read_model(reader, top["model"])
    inputs = _read_inputs(reader, top["inputs"])
    calibration = _read_calibration(reader, top["calibration"], inputs)
    quantization = _read_quantization(reader, top.get("quantization", {}))
    algorithms = _read_algorithms(reader, top.get("quantization", {}).get("algorithms", []))
    if algorithms.gptq is not None and not _uses_gptq(quantization):
        raise reader.fail(
            "quantization.algorithms.gptq",
            "sets the parameters of weight method gptq, but no weight uses it (set "
            "quantization.weights.method: gptq, or method gptq in an override)",
        )
    if algorithms.int8_fallback is not None and not _uses_4bit(quantization):
        raise reader.fail(
            "quantization.algorithms.int8_fallback",
            "keeps some 4-bit layers at 8 bits, but no weight is 4-bit (set "
            "quantization.weights.bits: 4, or bits 4 in an override)",
        )
    evaluation = None
    if "evaluation" in top:
        evaluation = _read_evaluation(reader, top["evaluation"], inputs)
    out = top.get("output", {})
    reader.mapping(out, "output", {"dir", "float_model"})
    float_model = reader.choice(
        out.get("float_model", "auto"), "output.float_model", FLOAT_MODEL_CHOICES
    )
    if output_dir is not None:
        out_path = Path(output_dir)
        if reader.probe(out_path, "--output-dir", Path.exists) and not out_path.is_dir():
            raise RecipeError(f"--output-dir {out_path}: is a file, not a folder")
    else:
        out_path = reader.base / reader.string(out.get("dir", "out"), "output.dir")
        if reader.probe(out_path, "output.dir", Path.exists) and not out_path.is_dir():
            raise reader.fail("output.dir", f"is a file, not a folder: {out_path}")
    seed = reader.integer(top.get("seed", 0), "seed", minimum=0)
    mixed = None
    if "mixed_precision" in top:
        mixed = _read_mixed_precision(reader, top["mixed_precision"], quantization, evaluation)
    qat = _read_qat(reader, top["qat"], inputs) if "qat" in top else None
    tuning = _read_tuning(reader, top["tuning"], inputs) if "tuning" in top else TuningSpec()
    return Recipe(
        recipe_path,
        model,
        inputs,
        calibration,
        quantization,
        evaluation,
        out_path,
        seed,
        mixed,
        qat,
        algorithms,
        tuning,
        float_model,
    )


def _weight_settings(quantization: QuantizationSpec) -> list[WeightSettings]:
    """The recipe's weight settings at every level: the default and each override's."""
    return [quantization.weights, *(o.weights for o in quantization.overrides)]


def _uses_4bit(quantization: QuantizationSpec) -> bool:
    return any(s.bits == 4 for s in _weight_settings(quantization))


def _uses_gptq(quantization: QuantizationSpec) -> bool:
    return any(s.method == "gptq" for s in _weight_settings(quantization))


def _apply_base(reader: _Reader, raw: Any, chain: list[Path]) -> Any:
    """Merge a `base:` (a preset by name, or a recipe file) under this recipe's own keys, by
    the rules of docs/recipe.md: mappings merge key by key, lists and `inputs:` replace, `null`
    removes what the base set, `algorithms: {}` removes every algorithm.

    Presets hold only settings (calibration method, target, op types), never paths, so they can
    be shared by recipes in any folder.
    """
    if not isinstance(raw, dict) or "base" not in raw:
        return raw
    name = reader.string(raw["base"], "base")
    folder = chain[-1].parent
    base_path = reader.probe(folder, "base", lambda f: presets.resolve_base(name, f))
    if base_path is None or not reader.probe(base_path, "base", Path.is_file):
        raise reader.fail(
            "base",
            f"no preset named {_show(name)} (presets: {', '.join(presets.names())}) and no file "
            f"{_show(str(folder / name))}",
        )
    if base_path in chain:
        raise reader.fail("base", f"presets include each other in a loop: {base_path}")
    try:
        base = load_yaml(base_path) or {}
    except RecipeError as exc:
        raise reader.fail("base", str(exc)) from None
    if not isinstance(base, dict):
        raise reader.fail("base", f"{base_path}: a preset must be a mapping")
    base = _apply_base(reader, base, [*chain, base_path])
    own = {key: value for key, value in raw.items() if key != "base"}
    return _deep_merge(base, own, top=True)


# Sections a derived recipe states whole: two recipes' inputs never mean the union of both.
_REPLACED_SECTIONS = ("inputs",)


def _deep_merge(base: dict, override: dict, top: bool = False) -> dict:
    merged = dict(base)
    for key, value in override.items():
        if value is None and key in merged:
            del merged[key]  # null: back to the default, whatever the base set
        elif top and key in _REPLACED_SECTIONS:
            merged[key] = value
        elif key == "algorithms" and value == {}:
            merged[key] = {}  # no algorithm at all, whichever the base turned on
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_model(reader: _Reader, raw: Any) -> ModelSpec:
    reader.mapping(raw, "model", {"onnx", "pytorch", "weights", "opset"})
    if ("onnx" in raw) == ("pytorch" in raw):
        raise reader.fail(
            "model", "give exactly one of 'onnx' (a file) or 'pytorch' (file.py:factory)"
        )
    if "weights" in raw and "pytorch" not in raw:
        raise reader.fail("model.weights", "only applies to a 'pytorch' model")
    opset = reader.integer(raw.get("opset", 17), "model.opset", minimum=17)
    if "onnx" in raw:
        return ModelSpec(onnx=reader.existing_file(raw["onnx"], "model.onnx"), opset=opset)
    weights = reader.existing_file(raw["weights"], "model.weights") if "weights" in raw else None
    return ModelSpec(
        pytorch=reader.entry_point(raw["pytorch"], "model.pytorch"), weights=weights, opset=opset
    )


def _read_inputs(reader: _Reader, raw: Any) -> tuple[InputSpec, ...]:
    if not isinstance(raw, dict) or not raw:
        raise reader.fail("inputs", "must map each model input name to its shape")
    specs = []
    for name, value in raw.items():
        where = f"inputs.{name}"
        if isinstance(value, dict):
            reader.mapping(value, where, {"shape", "dtype"}, {"shape"})
            shape = reader.shape(value["shape"], f"{where}.shape", empty_axes=True)
            dtype = reader.choice(value.get("dtype", "float32"), f"{where}.dtype", INPUT_DTYPES)
        else:
            shape, dtype = reader.shape(value, where, empty_axes=True), "float32"
        specs.append(InputSpec(str(name), shape, dtype))
    return tuple(specs)


def _read_data(reader: _Reader, raw: Any, where: str, inputs: tuple[InputSpec, ...]) -> DataSpec:
    kinds = {"npz", "npy", "images", "python", "text", "synthetic"}
    reader.mapping(raw, where, kinds | {"labels", "samples"})
    chosen = [k for k in ("npz", "npy", "images", "python", "text") if k in raw]
    synthetic = (
        reader.boolean(raw["synthetic"], f"{where}.synthetic") if "synthetic" in raw else False
    )
    if synthetic:
        chosen.append("synthetic")
    if len(chosen) != 1:
        raise reader.fail(
            where,
            "give exactly one data source: npz, npy, images, python, text, or synthetic: true",
        )
    if "samples" in raw and not synthetic:
        raise reader.fail(f"{where}.samples", "only applies to synthetic: true")
    if "labels" in raw and "npy" not in raw:
        raise reader.fail(f"{where}.labels", "only applies to an 'npy' source")
    kind = chosen[0]
    if kind == "npz":
        return DataSpec(where, npz=reader.existing_file(raw["npz"], f"{where}.npz"))
    if kind == "npy":
        files = raw["npy"]
        if not isinstance(files, dict) or not files:
            raise reader.fail(f"{where}.npy", "must map input names to .npy files")
        npy = {str(k): reader.existing_file(v, f"{where}.npy.{k}") for k, v in files.items()}
        labels = reader.existing_file(raw["labels"], f"{where}.labels") if "labels" in raw else None
        return DataSpec(where, npy=npy, labels=labels)
    if kind == "images":
        return DataSpec(where, images=_read_images(reader, raw["images"], f"{where}.images"))
    if kind == "python":
        return DataSpec(where, python=reader.entry_point(raw["python"], f"{where}.python"))
    if kind == "text":
        return DataSpec(where, text=_read_text(reader, raw["text"], f"{where}.text", inputs))
    samples = reader.integer(raw.get("samples", 64), f"{where}.samples", minimum=1)
    return DataSpec(where, synthetic=True, samples=samples)


def _read_text(reader: _Reader, raw: Any, where: str, inputs: tuple[InputSpec, ...]) -> TextSource:
    """`text: {files, tokenizer, window, stride, max_windows, bos}`; the window defaults to the
    sequence length of inputs.input_ids, and every input must be one the source can fill."""
    keys = {"files", "tokenizer", "window", "stride", "max_windows", "bos"}
    reader.mapping(raw, where, keys, {"files", "tokenizer"})
    files = _read_text_files(reader, raw["files"], f"{where}.files")
    tokenizer = reader.base / reader.string(raw["tokenizer"], f"{where}.tokenizer")
    found = reader.probe(tokenizer, f"{where}.tokenizer", tokenizer_file)
    if found is None:
        if reader.probe(tokenizer, f"{where}.tokenizer", Path.is_dir):
            raise reader.fail(
                f"{where}.tokenizer",
                f"folder {tokenizer} has no tokenizer.json (the Hugging Face tokenizers format "
                "that transformers' save_pretrained writes)",
            )
        raise reader.fail(f"{where}.tokenizer", f"file not found: {tokenizer}")
    ids = next((spec for spec in inputs if spec.name == "input_ids"), None)
    if "window" in raw:
        window = reader.integer(raw["window"], f"{where}.window", minimum=2)
    elif ids is not None and len(ids.shape) == 2:
        window = int(ids.shape[1])
    else:
        raise reader.fail(
            f"{where}.window", "is required when inputs: declares no input_ids [batch, tokens]"
        )
    bos = raw.get("bos", False)
    if not isinstance(bos, bool):
        bos = reader.string(bos, f"{where}.bos")
    elif bos and window < 3:
        raise reader.fail(f"{where}.window", f"with bos, must be >= 3, got {window}")
    problem = inputs_problem(inputs, window)
    if problem is not None:
        raise reader.fail(where, problem)
    stride = raw.get("stride")
    max_windows = raw.get("max_windows")
    return TextSource(
        files=files,
        tokenizer=found,
        window=window,
        stride=None if stride is None else reader.integer(stride, f"{where}.stride", minimum=1),
        max_windows=None
        if max_windows is None
        else reader.integer(max_windows, f"{where}.max_windows", minimum=1),
        bos=bos,
    )


def _read_text_files(reader: _Reader, raw: Any, where: str) -> tuple[Path, ...]:
    """A path, a glob, or a list of them; a glob's matches sorted, the list's order kept."""
    entries = [raw] if isinstance(raw, str) else raw
    if not isinstance(entries, list) or not entries:
        raise reader.fail(where, f"must be a file, a glob or a list of them, got {_show(raw)}")
    files: list[Path] = []
    for index, entry in enumerate(entries):
        key = where if isinstance(raw, str) else f"{where}[{index}]"
        text = reader.string(entry, key)
        if any(c in text for c in "*?["):
            if any(c in str(Path(text).parent) for c in "*?["):
                raise reader.fail(key, f"a glob may only match file names, got {_show(text)}")
            pattern = reader.base / text
            found = reader.probe(pattern, key, lambda p: list(p.parent.glob(p.name)))
            matches = sorted(p for p in found if p.is_file())
            if not matches:
                raise reader.fail(key, f"no file matches {pattern}")
            files += matches
        else:
            files.append(reader.existing_file(text, key))
    return tuple(files)


def _read_images(reader: _Reader, raw: Any, where: str) -> ImageFolder:
    keys = {"dir", "input", "size", "mode", "scale", "mean", "std"}
    reader.mapping(raw, where, keys, {"dir", "input", "size"})
    size = reader.shape(raw["size"], f"{where}.size")
    if len(size) != 2:
        raise reader.fail(f"{where}.size", f"must be [height, width], got {list(size)}")
    mode = reader.choice(raw.get("mode", "RGB"), f"{where}.mode", IMAGE_MODES)
    channels = 1 if mode == "L" else 3
    mean = reader.number_list(raw.get("mean", [0.0] * channels), f"{where}.mean")
    std = reader.number_list(raw.get("std", [1.0] * channels), f"{where}.std")
    for key, values in (("mean", mean), ("std", std)):
        if len(values) != channels:
            raise reader.fail(f"{where}.{key}", f"needs {channels} values for mode {mode}")
    if any(s <= 0 for s in std):
        raise reader.fail(f"{where}.std", "values must be > 0")
    scale = reader.number(raw.get("scale", 255.0), f"{where}.scale")
    if scale <= 0:
        raise reader.fail(f"{where}.scale", "must be > 0")
    return ImageFolder(
        dir=reader.existing_dir(raw["dir"], f"{where}.dir"),
        input=reader.string(raw["input"], f"{where}.input"),
        size=(size[0], size[1]),
        mode=mode,
        scale=scale,
        mean=mean,
        std=std,
    )


def _default_batch(data: DataSpec, default: int) -> int:
    """A text source's windows default to batch 1: the logits of one window of a decoder are
    window x vocabulary floats (512 tokens of a 49k vocabulary: 100 MB), and calibration keeps
    every quantized node's input of the batch besides."""
    return 1 if data.text is not None else default


def _read_calibration(reader: _Reader, raw: Any, inputs: tuple[InputSpec, ...]) -> CalibrationSpec:
    keys = {"data", "batch_size", "max_samples", "method", "percentile", "bins"}
    reader.mapping(raw, "calibration", keys, {"data"})
    percentile = reader.number(raw.get("percentile", 99.99), "calibration.percentile")
    if not 50.0 < percentile <= 100.0:
        raise reader.fail("calibration.percentile", f"must be in (50, 100], got {percentile}")
    bins = reader.integer(
        raw.get("bins", 2048), "calibration.bins", minimum=MIN_BINS, maximum=MAX_BINS
    )
    if bins % 2:
        raise reader.fail(
            "calibration.bins", f"must be even (the histogram is split at 0), got {bins}"
        )
    max_samples = raw.get("max_samples")
    data = _read_data(reader, raw["data"], "calibration.data", inputs)
    return CalibrationSpec(
        data=data,
        batch_size=reader.integer(
            raw.get("batch_size", _default_batch(data, 32)), "calibration.batch_size", minimum=1
        ),
        max_samples=None
        if max_samples is None
        else reader.integer(max_samples, "calibration.max_samples", minimum=1),
        method=reader.choice(raw.get("method", "entropy"), "calibration.method", METHODS),
        percentile=percentile,
        bins=bins,
    )


def _read_tuning(reader: _Reader, raw: Any, inputs: tuple[InputSpec, ...]) -> TuningSpec:
    """`tuning:` (docs/recipe.md): its own data, or the split of the calibration set."""
    raw = {} if raw is None else raw
    keys = {"data", "every", "max_samples", "batch_size", "baseline"}
    reader.mapping(raw, "tuning", keys)
    if "data" in raw and "every" in raw:
        raise reader.fail(
            "tuning.every", "splits the calibration set; it does not apply with tuning.data"
        )
    defaults = TuningSpec()
    return TuningSpec(
        data=_read_data(reader, raw["data"], "tuning.data", inputs) if "data" in raw else None,
        every=reader.integer(
            raw.get("every", defaults.every), "tuning.every", minimum=2, maximum=MAX_EVERY
        ),
        max_samples=reader.integer(
            raw.get("max_samples", defaults.max_samples), "tuning.max_samples", minimum=1
        ),
        batch_size=reader.integer(
            raw.get("batch_size", defaults.batch_size), "tuning.batch_size", minimum=1
        ),
        baseline=reader.choice(
            raw.get("baseline", defaults.baseline), "tuning.baseline", BASELINES
        ),
    )


def _read_quantization(reader: _Reader, raw: Any) -> QuantizationSpec:
    keys = {
        "target",
        "per_channel",
        "op_types",
        "exclude",
        "cpu",
        "saturation",
        "weights",
        "activations",
        "overrides",
        "algorithms",
        "int4_format",
        "accuracy_level",
        "precision",
        "float_type",
        "float_io",
        "dynamic_ranges",
    }
    reader.mapping(raw, "quantization", keys)
    op_types = _read_op_types(
        reader, raw.get("op_types", list(DEFAULT_OP_TYPES)), "quantization.op_types"
    )
    weights = _read_weights(reader, raw.get("weights", {}), "quantization.weights")
    if "per_channel" in raw:
        per_channel = reader.boolean(raw["per_channel"], "quantization.per_channel")
        if weights.granularity is not None and not per_channel:
            raise reader.fail(
                "quantization.per_channel",
                "conflicts with quantization.weights.granularity: set only the granularity",
            )
        # true was always the default: it means "not per-tensor", so blocks stay possible.
        if not per_channel:
            weights = weights.layered(WeightSettings(granularity="per-tensor"))
    activations = raw.get("activations")
    overrides = raw.get("overrides", [])
    if not isinstance(overrides, list):
        raise reader.fail("quantization.overrides", f"must be a list, got {overrides!r}")
    target = reader.choice(raw.get("target", "ort-cpu"), "quantization.target", TARGETS)
    int4_format = raw.get("int4_format")
    if int4_format is not None:
        int4_format = reader.choice(int4_format, "quantization.int4_format", INT4_FORMATS)
        if int4_format == "matmulnbits" and target != "ort-cpu":
            raise reader.fail(
                "quantization.int4_format",
                f"matmulnbits is ONNX Runtime's operator; target {target} reads qdq",
            )
    accuracy_level = str(raw.get("accuracy_level", "auto"))
    reader.choice(accuracy_level, "quantization.accuracy_level", ACCURACY_LEVEL_CHOICES)
    precision = raw.get("precision")
    if precision is not None:
        precision = reader.choice(precision, "quantization.precision", QUANTIZED_PRECISIONS)
        weights = _with_precision(reader, weights, precision, "quantization")
    if precision == "fp8" and activations == "float":
        raise reader.fail(
            "quantization.activations",
            "float contradicts precision fp8 (FP8 has no "
            "weight-only form: its activations are fp8)",
        )
    float_type = reader.choice(
        raw.get("float_type", "fp32"), "quantization.float_type", tuple(FLOAT_TYPES)
    )
    float_io = reader.choice(raw.get("float_io", "keep"), "quantization.float_io", FLOAT_IO)
    if float_io != "keep" and float_type == "fp32":
        raise reader.fail("quantization.float_io", "applies to a float_type other than fp32")
    spec = QuantizationSpec(
        target=target,
        int4_format=int4_format,
        accuracy_level=accuracy_level,
        op_types=op_types,
        exclude=reader.string_list(raw.get("exclude", []), "quantization.exclude"),
        cpu=reader.choice(raw.get("cpu", "auto"), "quantization.cpu", CPU_NAMES),
        saturation=reader.choice(
            raw.get("saturation", "auto"), "quantization.saturation", SATURATION_POLICIES
        ),
        weights=weights,
        activations=None
        if activations is None
        else reader.choice(activations, "quantization.activations", ACTIVATION_PRECISIONS),
        overrides=tuple(
            _read_override(reader, entry, f"quantization.overrides[{i}]")
            for i, entry in enumerate(overrides)
        ),
        precision=precision,
        float_type=float_type,
        float_io=float_io,
        dynamic_ranges=reader.choice(
            raw.get("dynamic_ranges", "per-tensor"), "quantization.dynamic_ranges", DYNAMIC_RANGES
        ),
    )
    _check_target_precisions(reader, spec)
    _check_dynamic(reader, spec)
    return spec


def _check_dynamic(reader: _Reader, spec: QuantizationSpec) -> None:
    """Dynamic int8 is ONNX Runtime's form (DynamicQuantizeLinear + MatMulInteger): refused for
    another target, and where the same level asks for weights MatMulInteger cannot multiply."""
    levels = [("quantization", spec.activations, spec.precision, spec.weights)]
    levels += [(o.where, o.activations, o.precision, o.weights) for o in spec.overrides]
    if spec.dynamic_ranges != "per-tensor" and all(level[1] != "dynamic" for level in levels):
        raise reader.fail(
            "quantization.dynamic_ranges",
            f"{spec.dynamic_ranges} applies to activations dynamic, which neither "
            "quantization.activations nor an override asks for",
        )
    for where, activations, precision, weights in levels:
        if activations != "dynamic":
            continue
        if spec.target not in DYNAMIC_TARGETS:
            raise reader.fail(
                f"{where}.activations",
                f"dynamic is ONNX Runtime's form (DynamicQuantizeLinear + MatMulInteger); target "
                f"{spec.target} has none (use {', '.join(DYNAMIC_TARGETS)}, or int8)",
            )
        if precision not in (None, "int8") or weights.bits not in (None, 8):
            asked = precision if precision not in (None, "int8") else f"{weights.bits}-bit weights"
            raise reader.fail(
                f"{where}.activations",
                f"dynamic needs int8 weights (MatMulInteger multiplies 8-bit ones), not {asked}",
            )
        if weights.granularity == "block":
            raise reader.fail(
                f"{where}.weights.granularity",
                "block contradicts activations dynamic (MatMulInteger takes per-channel or "
                "per-tensor weights)",
            )
        if spec.float_type != "fp32":
            raise reader.fail(
                "quantization.float_type",
                f"{spec.float_type} contradicts activations dynamic at {where} "
                "(DynamicQuantizeLinear reads FP32 only)",
            )


def _with_precision(
    reader: _Reader, weights: WeightSettings, precision: str, where: str
) -> WeightSettings:
    """The weight settings a precision implies (int4: 4 bits, int8 and fp8: 8), refusing the
    ones that contradict it; FP8 weights are amax / 448 per output channel, nothing else."""
    bits = {"int4": 4, "int8": 8, "fp8": 8}.get(precision)
    if bits is None:
        return weights
    if weights.bits is not None and weights.bits != bits:
        raise reader.fail(
            f"{where}.weights.bits", f"{weights.bits} contradicts precision {precision!r}"
        )
    if precision == "fp8":
        if weights.granularity == "block" or weights.block_size is not None:
            raise reader.fail(
                f"{where}.weights",
                "fp8 weights have one scale per output channel (or per tensor), not blocks",
            )
        if weights.method not in (None, "minmax"):
            raise reader.fail(
                f"{where}.weights.method",
                f"{weights.method} is for integer weights; fp8 weights are scaled by amax / 448",
            )
    return weights.layered(WeightSettings(bits=bits))


def _check_target_precisions(reader: _Reader, spec: QuantizationSpec) -> None:
    """FP8 and BF16 are TensorRT's: ORT's CPU provider has no BF16 kernels and cannot fuse
    float8 Q/DQ, so a recipe for ort-cpu that asks for them is refused up front."""
    offered = TARGET_PRECISIONS[spec.target]
    asked = [("quantization.precision", spec.precision)]
    asked.append(("quantization.float_type", FLOAT_TYPES[spec.float_type]))
    asked += [(f"{o.where}.precision", o.precision) for o in spec.overrides]
    for where, precision in asked:
        if precision is not None and precision not in offered:
            runs = ", ".join(t for t, p in TARGET_PRECISIONS.items() if precision in p)
            raise reader.fail(
                where, f"{precision} is not offered by target {spec.target} (it is for {runs})"
            )


def read_algorithms(raw: Any, source: str) -> Algorithms:
    """`quantization.algorithms` given outside a recipe file (benchmarks' `--algorithms`),
    validated as in a recipe; errors name `source` where a recipe error names the file."""
    return _read_algorithms(_Reader(Path(source)), raw)


def _read_algorithms(reader: _Reader, raw: Any) -> Algorithms:
    """`[bias_correction]` or `{bias_correction: {samples: 128}}`; run in ALGORITHM_ORDER."""
    where = "quantization.algorithms"
    if isinstance(raw, list):
        entries = {reader.string(name, f"{where}[{i}]"): {} for i, name in enumerate(raw)}
    elif isinstance(raw, dict):
        entries = {str(name): params if params is not None else {} for name, params in raw.items()}
    else:
        raise reader.fail(where, f"must be a list of names or a mapping, got {raw!r}")
    chosen: dict[str, AlgorithmParams] = {}
    for name in ALGORITHM_ORDER:
        if name not in entries:
            continue
        if name not in ALGORITHM_PARAMS:
            raise reader.fail(f"{where}.{name}", "is not implemented in this version of qtool yet")
        params = defaults(name)
        if name == "smoothquant" and isinstance(entries[name], dict) and "rows" in entries[name]:
            raise reader.fail(
                f"{where}.smoothquant.rows",
                "no longer used: alpha is scored on the tuning rows (set how many with "
                "tuning.max_samples)",
            )
        given = reader.mapping(entries[name], f"{where}.{name}", set(params))
        for key, value in given.items():
            if (name, key) == ("smoothquant", "alpha"):
                params[key] = _read_alpha(reader, value, f"{where}.{name}.{key}")
            elif (name, key) == ("smoothquant", "objective"):
                params[key] = reader.choice(value, f"{where}.{name}.{key}", SMOOTHQUANT_OBJECTIVES)
            elif name == "cross_layer_equalization" and key in ("bias_absorption", "through_clip"):
                params[key] = reader.boolean(value, f"{where}.{name}.{key}")
            elif (name, key) == ("gptq", "act_order"):
                params[key] = reader.boolean(value, f"{where}.{name}.{key}")
            elif (name, key) == ("gptq", "damp"):
                params[key] = _read_fraction(reader, value, f"{where}.{name}.{key}", 0.0, 1.0)
            elif (name, key) == ("int8_fallback", "ratio"):
                params[key] = _read_fraction(reader, value, f"{where}.{name}.{key}", 0.0, 1.0)
            elif (name, key) == ("scale_estimation", "min_factor"):
                params[key] = _read_fraction(reader, value, f"{where}.{name}.{key}", 0.05, 1.0)
            elif (name, key) == ("scale_estimation", "refine"):
                params[key] = reader.integer(value, f"{where}.{name}.{key}", minimum=0, maximum=10)
            elif (name, key) == ("scale_estimation", "steps"):
                params[key] = reader.integer(
                    value, f"{where}.{name}.{key}", minimum=1, maximum=MAX_SCALE_STEPS
                )
            elif (name, key) == ("awq", "grid"):
                params[key] = reader.integer(
                    value, f"{where}.{name}.{key}", minimum=1, maximum=MAX_AWQ_GRID
                )
            elif (name, key) == ("adaround", "iterations"):
                params[key] = reader.integer(
                    value, f"{where}.{name}.{key}", minimum=1, maximum=MAX_ADAROUND_ITERATIONS
                )
            else:
                params[key] = reader.integer(value, f"{where}.{name}.{key}", minimum=1)
        chosen[name] = ALGORITHM_PARAMS[name](**params)
    unknown = sorted(set(entries) - set(ALGORITHM_ORDER))
    if unknown:
        raise reader.fail(
            f"{where}.{unknown[0]}", f"unknown algorithm (known: {', '.join(ALGORITHM_ORDER)})"
        )
    return Algorithms(**chosen)


def _read_alpha(reader: _Reader, value: Any, where: str) -> str | float:
    """SmoothQuant's alpha: "auto" or a number in [0, 1] (0 leaves the layer unsmoothed)."""
    if value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise reader.fail(where, f"must be auto or a number in [0, 1], got {_show(value)}")
    if not 0.0 <= float(value) <= 1.0:
        raise reader.fail(where, f"must be in [0, 1], got {_show(value)}")
    return float(value)


def _read_fraction(reader: _Reader, value: Any, where: str, low: float, high: float) -> float:
    """A number in [low, high]."""
    number = reader.number(value, where)
    if not low <= number <= high:
        raise reader.fail(where, f"must be in [{low:g}, {high:g}], got {_show(value)}")
    return number


def _read_op_types(reader: _Reader, raw: Any, where: str) -> tuple[str, ...]:
    op_types = reader.string_list(raw, where)
    for index, op_type in enumerate(op_types):
        reader.choice(op_type, f"{where}[{index}]", quantizable_op_types())
    return op_types


def _read_weights(reader: _Reader, raw: Any, where: str) -> WeightSettings:
    reader.mapping(raw, where, {"bits", "granularity", "block_size", "method", "symmetric"})
    bits = raw.get("bits")
    if bits is not None and bits not in (4, 8):
        raise reader.fail(f"{where}.bits", f"must be 4 or 8, got {bits!r}")
    block_size = raw.get("block_size")
    if block_size is not None:
        block_size = reader.integer(block_size, f"{where}.block_size")
        if block_size not in BLOCK_SIZES:
            sizes = ", ".join(map(str, BLOCK_SIZES))
            raise reader.fail(f"{where}.block_size", f"must be one of {sizes}, got {block_size}")
    granularity = raw.get("granularity")
    if granularity is not None:
        reader.choice(granularity, f"{where}.granularity", WEIGHT_GRANULARITIES)
        if block_size is not None and granularity != "block":
            raise reader.fail(
                f"{where}.block_size", f"applies to granularity 'block', not {granularity!r}"
            )
    method = raw.get("method")
    symmetric = raw.get("symmetric")
    return WeightSettings(
        bits=bits,
        granularity=granularity,
        block_size=block_size,
        method=None if method is None else reader.choice(method, f"{where}.method", WEIGHT_METHODS),
        symmetric=None if symmetric is None else reader.boolean(symmetric, f"{where}.symmetric"),
    )


def _read_override(reader: _Reader, raw: Any, where: str) -> Override:
    keys = {"nodes", "op_types", "roles", "precision", "weights", "activations", "constant_weight"}
    reader.mapping(raw, where, keys)
    nodes = raw.get("nodes", [])
    nodes = reader.string_list([nodes] if isinstance(nodes, str) else nodes, f"{where}.nodes")
    op_types = raw.get("op_types", [])
    op_types = _read_op_types(
        reader, [op_types] if isinstance(op_types, str) else op_types, f"{where}.op_types"
    )
    constant_weight = raw.get("constant_weight")
    if constant_weight is not None:
        constant_weight = reader.boolean(constant_weight, f"{where}.constant_weight")
    roles = raw.get("roles", [])
    roles = reader.string_list([roles] if isinstance(roles, str) else roles, f"{where}.roles")
    for index, role in enumerate(roles):
        reader.choice(role, f"{where}.roles[{index}]", ROLES)
    if not nodes and not op_types and not roles:
        raise reader.fail(
            where,
            "needs `nodes` (name globs), `op_types` or `roles` (attention, mlp-down) to say what "
            "it matches",
        )
    weights = _read_weights(reader, raw.get("weights", {}), f"{where}.weights")
    precision = raw.get("precision")
    activations = raw.get("activations")
    if precision is not None:
        reader.choice(precision, f"{where}.precision", PRECISIONS)
        weights = _with_precision(reader, weights, precision, where)
        if precision in FLOAT_TYPES.values() and ("weights" in raw or activations is not None):
            raise reader.fail(
                where, f"precision {precision} has no Q/DQ: weights and activations do not apply"
            )
        if precision == "fp8" and activations == "float":
            raise reader.fail(f"{where}.activations", "float contradicts precision fp8")
    return Override(
        where=where,
        nodes=nodes,
        op_types=op_types,
        roles=roles,
        precision=precision,
        weights=weights,
        activations=None
        if activations is None
        else reader.choice(activations, f"{where}.activations", ACTIVATION_PRECISIONS),
        constant_weight=constant_weight,
    )


def _read_evaluation(reader: _Reader, raw: Any, inputs: tuple[InputSpec, ...]) -> EvaluationSpec:
    keys = {"data", "batch_size", "output", "metric", "max_drop", "min_cosine", "min_sqnr"}
    keys |= {"accuracy_level", "rows"}
    reader.mapping(raw, "evaluation", keys, {"data"})
    rows = raw.get("rows")
    if rows is not None:
        rows = reader.string_list(rows, "evaluation.rows")
        problem = rows_problem(rows)
        if problem is not None:
            raise reader.fail("evaluation.rows", problem)
    accuracy_level = raw.get("accuracy_level")
    if accuracy_level is not None:
        accuracy_level = reader.integer(accuracy_level, "evaluation.accuracy_level", minimum=0)
        if accuracy_level > 4:
            raise reader.fail("evaluation.accuracy_level", f"must be 0..4, got {accuracy_level}")
    gates: dict[str, float | None] = {}
    for key in ("max_drop", "min_cosine", "min_sqnr"):
        value = raw.get(key)
        if value is not None:
            value = reader.number(value, f"evaluation.{key}")
            problem = gate_problem(key, value)
            if problem is not None:
                raise reader.fail(f"evaluation.{key}", problem)
        gates[key] = value
    output = raw.get("output")
    metric = raw.get("metric")
    data = _read_data(reader, raw["data"], "evaluation.data", inputs)
    return EvaluationSpec(
        data=data,
        batch_size=reader.integer(
            raw.get("batch_size", _default_batch(data, 64)), "evaluation.batch_size", minimum=1
        ),
        output=None if output is None else reader.string(output, "evaluation.output"),
        metric=None if metric is None else reader.choice(metric, "evaluation.metric", GATE_METRICS),
        accuracy_level=accuracy_level,
        rows=rows,
        **gates,
    )


def _read_mixed_precision(
    reader: _Reader,
    raw: Any,
    quantization: QuantizationSpec,
    evaluation: EvaluationSpec | None,
) -> MixedPrecisionSpec:
    where = "mixed_precision"
    raw = {} if raw is None else raw
    reader.mapping(raw, where, {"objective", "budget", "candidates", "max_iterations", "samples"})
    if evaluation is None:
        raise reader.fail(where, "needs an evaluation: section (plans are verified on its data)")
    objective = reader.choice(raw.get("objective", "size"), f"{where}.objective", MIXED_OBJECTIVES)
    budget = None
    if "budget" in raw:
        budget = _read_budget(reader, raw["budget"], f"{where}.budget")
    elif all(getattr(evaluation, k) is None for k in ("max_drop", "min_cosine", "min_sqnr")):
        raise reader.fail(
            f"{where}.budget",
            "is required when evaluation: sets no gate (max_drop, min_cosine or min_sqnr)",
        )
    candidates = None
    if "candidates" in raw:
        key = f"{where}.candidates"
        candidates = reader.string_list(raw["candidates"], key)
        for index, name in enumerate(candidates):
            reader.choice(name, f"{key}[{index}]", PRECISIONS)
            if name in candidates[:index]:
                raise reader.fail(f"{key}[{index}]", f"{name!r} is listed twice")
        if not set(candidates) - {"float"}:
            raise reader.fail(
                key, "needs int4, int8, fp8, fp16 or bf16 (float alone leaves nothing to choose)"
            )
        if "int4" in candidates and quantization.target == "tensorrt":
            raise reader.fail(
                key, "int4 is not a candidate for target tensorrt (qtool writes int8 for it)"
            )
        offered = TARGET_PRECISIONS[quantization.target]
        for index, name in enumerate(candidates):
            if name not in offered:
                raise reader.fail(
                    f"{key}[{index}]", f"{name} is not offered by target {quantization.target}"
                )
        candidates = tuple(p for p in PRECISIONS if p in candidates)
    return MixedPrecisionSpec(
        objective=objective,
        budget=budget,
        candidates=candidates,
        max_iterations=reader.integer(
            raw.get("max_iterations", 8), f"{where}.max_iterations", minimum=1, maximum=10_000
        ),
        samples=reader.integer(raw.get("samples", 128), f"{where}.samples", minimum=1),
    )


def _read_budget(reader: _Reader, raw: Any, where: str) -> BudgetSpec:
    """Exactly one limit; `metric` only says what max_drop counts, or repeats what a floor is."""
    reader.mapping(raw, where, {"metric", "max_drop", "min_cosine", "min_sqnr"})
    limits = [key for key in ("max_drop", "min_cosine", "min_sqnr") if key in raw]
    if len(limits) != 1:
        raise reader.fail(where, "give exactly one of max_drop, min_cosine or min_sqnr")
    key = limits[0]
    value = reader.number(raw[key], f"{where}.{key}")
    problem = gate_problem(key, value)
    if problem is not None:
        raise reader.fail(f"{where}.{key}", problem)
    metric = raw.get("metric")
    if metric is not None:
        metric = reader.choice(metric, f"{where}.metric", MIXED_METRICS)
        allowed = {"max_drop": GATE_METRICS, "min_cosine": ("cosine",), "min_sqnr": ("sqnr",)}
        if metric not in allowed[key]:
            raise reader.fail(
                f"{where}.metric",
                f"{metric!r} does not go with {key} (which counts {', '.join(allowed[key])})",
            )
    return BudgetSpec(metric=metric, **{key: value})


def _read_qat(reader: _Reader, raw: Any, inputs: tuple[InputSpec, ...]) -> QatSpec:
    keys = {"epochs", "lr", "optimizer", "batch_size", "seed", "data", "loss", "learn_scales"}
    reader.mapping(raw if raw is not None else {}, "qat", keys)
    raw = raw or {}
    lr = reader.number(raw.get("lr", 1e-4), "qat.lr")
    if not math.isfinite(lr) or lr <= 0:
        raise reader.fail("qat.lr", f"must be a finite number > 0, got {lr}")
    loss = raw.get("loss")
    if loss is not None:
        text = reader.string(loss, "qat.loss")
        loss = text if text in QAT_LOSSES else None
        if loss is None:
            if ":" not in text:
                raise reader.fail(
                    "qat.loss",
                    f"must be one of {', '.join(QAT_LOSSES)} or 'file.py:function', got {text!r}",
                )
            loss = reader.entry_point(text, "qat.loss")
    seed = raw.get("seed")
    return QatSpec(
        epochs=reader.integer(raw.get("epochs", 3), "qat.epochs", minimum=1),
        lr=lr,
        optimizer=reader.choice(raw.get("optimizer", "adam"), "qat.optimizer", QAT_OPTIMIZERS),
        batch_size=reader.integer(raw.get("batch_size", 32), "qat.batch_size", minimum=1),
        seed=None if seed is None else reader.integer(seed, "qat.seed", minimum=0),
        data=_read_data(reader, raw["data"], "qat.data", inputs) if "data" in raw else None,
        loss=loss,
        learn_scales=reader.boolean(raw.get("learn_scales", False), "qat.learn_scales"),
    )
