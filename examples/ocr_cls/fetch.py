"""Fetch the OCR text-direction classifier and the page image this example runs on (once, cached).

Both are real and ship inside package-registry wheels, so nothing comes from a model hub:
- `rapidocr_onnxruntime==1.4.4` ships PaddleOCR's `ch_ppocr_mobile_v2.0_cls_infer.onnx`, a
  MobileNetV3-small text-line classifier (0 vs 180 degrees; depthwise convolutions, ReLU and
  hard-swish, squeeze-excite) pretrained by PaddleOCR;
- `scikit-image==0.26.0` ships `skimage/data/page.png`, a photographed book page (the image
  `skimage.data.page()` returns; inside the wheel, not fetched by pooch).

The wheels are only downloaded (`pip download --no-deps`), never installed: rapidocr depends on
the CPU `onnxruntime`, which would replace `onnxruntime-gpu` in the environment. The two files
are read out of the zips into `fetched/` beside this file; a second run finds them and does
nothing. The digests below make a changed upload an error instead of silently different numbers.

    python examples/ocr_cls/fetch.py
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
FETCHED = HERE / "fetched"
MODEL = FETCHED / "ch_ppocr_mobile_v2.0_cls_infer.onnx"
PAGE = FETCHED / "page.png"
# (destination, requirement, file inside the wheel, sha256 of that file)
FILES = (
    (
        MODEL,
        "rapidocr_onnxruntime==1.4.4",
        "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c",
    ),
    (
        PAGE,
        "scikit-image==0.26.0",
        "skimage/data/page.png",
        "341a6f0a61557662b02734a9b6e56ec33a915b2c41886b97509dedf2a43b47a3",
    ),
)


class FetchError(RuntimeError):
    """pip or the package registry is unavailable, or a wheel is not what it was."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _download(requirement: str, folder: Path) -> Path:
    """`pip download REQ --no-deps`: the one wheel for this Python and platform."""
    command = [sys.executable, "-m", "pip", "download", requirement, "--no-deps", "-q"]
    command += ["-d", str(folder)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FetchError(f"{requirement}: could not run pip download ({exc})") from exc
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise FetchError(
            f"{requirement}: pip download failed ({tail[0]}); this example needs the package "
            "registry once (afterwards the files are cached in examples/ocr_cls/fetched/)"
        )
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"{requirement}: expected one wheel from pip download, got {wheels}")
    return wheels[0]


def fetch_one(dest: Path, requirement: str, member: str, digest: str) -> bool:
    """Extract `member` of `requirement`'s wheel to `dest`; False when already there."""
    if dest.is_file() and _sha256(dest.read_bytes()) == digest:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        wheel = _download(requirement, Path(tmp))
        with zipfile.ZipFile(wheel) as archive:
            try:
                data = archive.read(member)
            except KeyError as exc:
                raise FetchError(f"{wheel.name}: has no {member}") from exc
    if _sha256(data) != digest:
        raise FetchError(f"{requirement} {member}: sha256 {_sha256(data)}, expected {digest}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(f".{dest.name}.tmp")
    partial.write_bytes(data)
    os.replace(partial, dest)  # never a half-written file under the final name
    return True


def fetch() -> list[Path]:
    """Every file of FILES, downloading only what is missing; returns their paths."""
    for dest, requirement, member, digest in FILES:
        if fetch_one(dest, requirement, member, digest):
            print(f"fetched {dest.relative_to(HERE.parent.parent)} from {requirement}")
    return [dest for dest, *_ in FILES]


def main() -> int:
    try:
        for path in fetch():
            print(f"ok {path}")
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
