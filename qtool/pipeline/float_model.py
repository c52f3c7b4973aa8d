"""The float model handle: the prepared graph, its serialized bytes and the fingerprint that
ties statistics files and quantized models to exactly this graph.

Every later stage reads the same handle. Its `fingerprint` is the SHA-256 of the float model file
written beside the quantized one; a stats file records it, and reading statistics collected on
another model is refused instead of silently applying ranges to the wrong tensors.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import onnx

from qtool.data.spec import InputSpec
from qtool.errors import ModelError
from qtool.io import Staged, stage
from qtool.model import external_data, provenance
from qtool.model.load import load_model
from qtool.model.prepare import prepare_model
from qtool.model.spec import ModelSpec
from qtool.phases import phase


@dataclass
class FloatModel:
    # None while a staged model's weights are left to the file: during calibration, after writing
    model: onnx.ModelProto | None
    serialized: bytes | None  # the float model file; None when it is staged as external data
    fingerprint: str
    source_sha256: str
    # Models over the protobuf limit: the float model written as external data, not committed.
    staged: external_data.StagedModel | None = None
    # The float model file written ahead of the commit, so calibration need not hold its bytes.
    # It holds `serialized`, of which `model` is the parse: calibration copies it rather than
    # serializing `model` again, so nothing may change `model` before calibration.
    float_file: Staged | None = None
    # The user's model file in bytes (ONNX: with its external data; PyTorch: the export),
    # what sizes are reported against (provenance.SOURCE_MODEL_BYTES).
    source_bytes: int | None = None
    # A staged model held with lazy weights (external_data.lazy_file): every large initializer
    # read from the staged file when a stage needs it (the weight being quantized), none held.
    lazy: bool = False
    # Whether a staged model's files are outputs of the command (`output.float_model: always`,
    # or `auto` under protobuf's limit); else they are temporary, removed by `discard` (no 2 GB
    # float copy left in the folder).
    commit_staged: bool = True
    # Over protobuf's limit (then staged whatever its use); a model under it may be staged too
    # (external_data.STAGE_WEIGHTS_THRESHOLD), and still be held as one protobuf when a stage
    # needs its bytes (`hold_bytes`).
    over_limit: bool = False

    def materialize(self) -> None:
        """Read a lazy model's weights in: for the stages that rewrite or read the whole float
        model (SmoothQuant, AdaRound, bias correction, the float typing pass, the search)."""
        if self.lazy and self.staged is not None:
            self.model = None  # dropped before the read: never held twice
            self.model = self.staged.load()
            self.lazy = False

    def hold_bytes(self) -> None:
        """Hold the float model as one serialized protobuf (read in first when lazy), for the
        stages that hand it to ONNX Runtime sessions many times (the search, analyze). A model
        over protobuf's limit has no such form: `serialized` stays None."""
        if self.serialized is None and not self.over_limit:
            self.materialize()
            if self.model is None and self.staged is not None:
                self.model = self.staged.load()
            self.serialized = self.model.SerializeToString()

    def structure(self) -> onnx.ModelProto:
        """The float graph for readers of its nodes only (plan.yaml): the proto when held, else
        the staged file without its weights (a build of a staged model lets go of the proto),
        else parsed from the bytes."""
        if self.model is not None:
            return self.model
        if self.staged is not None:
            return self.staged.structure()
        if self.serialized is not None:
            return onnx.load_from_string(self.serialized)
        if self.float_file is not None:
            return onnx.load(str(self.float_file.path))
        raise ValueError("the float model is held in no form")

    def float_files(self, path: Path) -> dict[Path, bytes | Staged]:
        """The float model file(s) to commit at `path` (the path given to `freeze`); none for a
        staged model that is not to be kept (`commit_staged`)."""
        if self.staged is None:
            return {path: self.float_file if self.float_file is not None else self.serialized}
        if self.staged.path != path:
            raise ValueError(f"the float model was staged for {self.staged.path}, not {path}")
        return self.staged.files() if self.commit_staged else {}

    def release(self, path: Path) -> onnx.ModelProto | None:
        """Hand the ModelProto to the caller and let go of the serialized bytes, staging them as
        the float model file for `path` first (written once, committed with the other outputs).
        An ONNX Runtime session holds the model as well: without this the process would hold it
        three times while calibrating (bert benchmark: 759 MB peak against the 557 MB of a bare
        session). `restore` reads both back."""
        serialized = self.serialized
        if self.staged is None and serialized is not None:
            if self.float_file is None:  # else staged by an earlier release of this run
                self.float_file = stage(path, lambda handle: handle.write(serialized))
            self.serialized = None
        model, self.model = self.model, None
        return model

    def restore(self) -> None:
        """Undo `release`: the bytes from the staged float model file, the proto parsed from
        them (the same bytes the fingerprint was computed from)."""
        if self.serialized is None and self.float_file is not None:
            self.serialized = self.float_file.path.read_bytes()
        if self.model is None and self.serialized is not None:
            self.model = onnx.load_from_string(self.serialized)

    def discard(self) -> None:
        """Remove the staged float model's temporary files (a run that fails before committing)."""
        if self.staged is not None:
            self.staged.discard()
        if self.float_file is not None:
            self.float_file.discard()

    def session_source(self) -> bytes | Path:
        """What an ONNX Runtime session loads the float model from: its bytes, or the staged
        file when its weights live in external data or the bytes were let go (`spill`)."""
        if self.staged is not None:
            return self.staged.session_path
        if self.serialized is None and self.float_file is not None:
            return self.float_file.path
        return self.serialized

    def spill(self, path: Path) -> None:
        """Write the serialized float model to its staged file for `path` (the commit renames
        it into place) and let go of the bytes: the proto is what the build reads, and holding
        both kept the float model twice through the build and verification (a 653 MB decoder:
        1.3 GB). Sessions then open the file (`session_source`)."""
        serialized = self.serialized
        if self.staged is None and serialized is not None:
            if self.float_file is None:
                self.float_file = stage(path, lambda handle: handle.write(serialized))
            self.serialized = None


def source_sha256(spec: ModelSpec, onnx_digest: hashlib._Hash | None = None) -> str:
    """The model as the user gave it: the ONNX file, or the PyTorch factory and weights file.
    `onnx_digest`: the ONNX source's hash, fed by load_model as it read the file."""
    if spec.onnx is not None:
        if onnx_digest is not None:
            return onnx_digest.hexdigest()
        return provenance.sha256_model(spec.onnx)
    digest = hashlib.sha256(str(spec.pytorch).encode())
    if spec.weights is not None:
        digest.update(provenance.sha256_file(spec.weights).encode())
    return digest.hexdigest()


def source_file_bytes(
    spec: ModelSpec, loaded: onnx.ModelProto, read_files: list[Path] | None = None
) -> int:
    """The size of the model as the user gave it: the ONNX file and its external data, or for
    a PyTorch source the model qtool exported (`loaded`, before preparation).

    `read_files`: the files load_model just read (the model file, then its external data),
    measured on disk; listing them anew re-reads and re-parses an inline model (a second 1 GB
    parse of Gemma 3 270M's file beside the loaded one)."""
    if read_files:
        return sum(f.stat().st_size for f in read_files)
    if spec.onnx is not None:
        return external_data.model_file_bytes(Path(spec.onnx))
    return loaded.ByteSize()


def load_prepared(
    spec: ModelSpec, inputs: tuple[InputSpec, ...], min_opset: int
) -> tuple[onnx.ModelProto, str, int]:
    """The user's model loaded (or exported from PyTorch) and prepared, its source hash and
    its source size in bytes."""
    onnx_digest = hashlib.sha256()
    read_files: list[Path] = []
    loaded = load_model(spec, inputs, onnx_digest, read_files)
    source = source_sha256(spec, onnx_digest)
    size = source_file_bytes(spec, loaded, read_files)
    return prepare_in_place(loaded, min_opset, str(spec.onnx or spec.pytorch)), source, size


def prepare_in_place(model: onnx.ModelProto, min_opset: int, where: str) -> onnx.ModelProto:
    """prepare_model without a copy: a model over 2 GB must not be held twice. Its errors name
    `where` the model came from (the ONNX file, the PyTorch factory), not the graph's own name."""
    with phase("preparing graph"):
        try:
            return prepare_model(model, min_opset=min_opset, copy=False)
        except ModelError as exc:
            raise ModelError(f"{where}: {exc}") from None


# A prepared model holding at most this much in memory (small initializers, folded constants)
# beside its lazy weights is staged deferred: held as it is, not re-read from the staged file.
DEFER_HELD_BYTES = 64 << 20


def freeze(
    model: onnx.ModelProto, float_path: Path, source: str, source_bytes: int | None = None
) -> FloatModel:
    """The handle on `model` as it will be written to `float_path` (nothing is written yet,
    except a model over protobuf's limit, staged as external data beside `float_path`);
    `source_bytes`: the user's model file's size (source_file_bytes).

    A staged model comes back lazy (its weights stay in the staged file): the caller still holds
    `model` during this call, so reading the weights back here would hold them twice; a caller
    that needs them calls `materialize` once it has dropped `model`."""
    if external_data.stages_weights(model):
        # Over protobuf's limit, or large (STAGE_WEIGHTS_THRESHOLD): staged as external data
        # beside model.fp32.onnx (hashed while it is written); read back from there (lazily)
        # for the reason the small path re-parses.
        over_limit = external_data.needs_external_data(model)
        if external_data.all_weights_on_disk(model, DEFER_HELD_BYTES):
            # Its weights are in the user's files already: hashed now, written only if a stage
            # opens it or the float copy is kept; the model goes on reading them from there.
            with phase("hashing the float model"):
                staged = external_data.stage_model(model, float_path, defer=True)
            lazy = model
        else:
            with phase("writing the float model (external data)"):
                staged = external_data.stage_model(model, float_path)
                del model
                lazy = staged.lazy()
        return FloatModel(
            lazy,
            None,
            staged.sha256,
            source,
            staged,
            lazy=True,
            source_bytes=source_bytes,
            over_limit=over_limit,
        )
    serialized = model.SerializeToString()
    fingerprint = hashlib.sha256(serialized).hexdigest()
    # Re-parsed from its bytes: the proto that preparation built holds on to the memory of every
    # intermediate copy (on the benchmark encoder 512 MB before calibration, 257 MB after this).
    model = onnx.load_from_string(serialized)
    return FloatModel(model, serialized, fingerprint, source, source_bytes=source_bytes)
