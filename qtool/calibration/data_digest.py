"""The calibration data fingerprint: a multiset hash that shards compute apart and merge exactly.

A sequential SHA-256 over the input stream (what qtool recorded before) depends on the order the
samples were read in, so processes or machines that each read a slice of the calibration set
could never reproduce it. Here every sample gets its own SHA-256 (over all its inputs: name,
dtype, sample shape and bytes, inputs in name order, so two inputs cannot trade samples unseen),
and the fingerprint accumulates the sum of those digests modulo 2**256 and the sample count.
Addition is associative and commutative, so any split of the samples into shards, in any order,
sums to the same value: the per-shard state is 40 bytes whatever the sample count, merges by
addition, and the recorded `data_sha256` is SHA-256 over (scheme, count, sum).

Properties that follow, by design:
- it ignores the batch size and the sample order (the statistics ignore both too); a different
  subset (another `max_samples` or seed) or a changed sample changes it;
- a duplicated sample counts twice (a multiset, not a set).

What it is not: a commitment against an adversary. Sums of hashes admit generalized-birthday
forgeries (Wagner's k-tree algorithm) for someone who sets out to build a colliding set; the
fingerprint is provenance against mix-ups (another data set, another subset), not a signature.
Sorting the per-sample digests and hashing them would be collision resistant, but costs 32 bytes
per sample in every shard file and in every process, which is unbounded in the sample count.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from qtool.errors import CalibrationError

if TYPE_CHECKING:
    from qtool.data.batches import Batch

SCHEME = "sha256-per-sample-sum-mod-2^256/1"
_MODULUS = 1 << 256


@dataclass
class DataDigest:
    """The running fingerprint of a multiset of calibration samples."""

    samples: int = 0
    total: int = 0  # sum of per-sample SHA-256 values (big-endian integers) mod 2**256

    def update(self, batch: Batch) -> None:
        """Add every sample of `batch` (its inputs' leading dimension is the sample axis)."""
        names = sorted(batch.inputs)
        arrays = [np.ascontiguousarray(batch.inputs[name]) for name in names]
        headers = [
            f"{name}\0{array.dtype.str}\0{array.shape[1:]}\0".encode()
            for name, array in zip(names, arrays, strict=True)
        ]
        total = self.total
        for row in range(len(batch)):
            digest = hashlib.sha256()
            for header, array in zip(headers, arrays, strict=True):
                digest.update(header)
                digest.update(array[row : row + 1])  # contiguous: hashed without a copy
            total += int.from_bytes(digest.digest(), "big")
        self.total = total % _MODULUS
        self.samples += len(batch)

    def tap(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """Pass `batches` through, adding each to the fingerprint on the way."""
        for batch in batches:
            self.update(batch)
            yield batch

    def merged(self, *others: DataDigest) -> DataDigest:
        """The fingerprint of all the samples of self and others (exact, in any order)."""
        total, samples = self.total, self.samples
        for other in others:
            total, samples = total + other.total, samples + other.samples
        return DataDigest(samples, total % _MODULUS)

    def hexdigest(self) -> str:
        return hashlib.sha256(f"{SCHEME}:{self.samples}:{self.total:064x}".encode()).hexdigest()

    def to_json(self) -> dict:
        return {"scheme": SCHEME, "samples": self.samples, "sum": f"{self.total:064x}"}

    @classmethod
    def from_json(cls, value: object, where: str) -> DataDigest:
        """Read back `to_json`'s dict; `where` names the file for the error message."""
        if not isinstance(value, dict) or value.get("scheme") != SCHEME:
            scheme = value.get("scheme") if isinstance(value, dict) else value
            raise CalibrationError(
                f"{where}: data_digest scheme {scheme!r} is not {SCHEME!r} (a file from another "
                "qtool version: re-run `qtool calibrate`)"
            )
        samples, text = value.get("samples"), value.get("sum")
        if type(samples) is not int or samples < 0:
            raise CalibrationError(f"{where}: data_digest samples must be a count, got {samples!r}")
        if not isinstance(text, str) or len(text) != 64:
            raise CalibrationError(f"{where}: data_digest sum must be 64 hex digits, got {text!r}")
        try:
            total = int(text, 16)
        except ValueError:
            raise CalibrationError(
                f"{where}: data_digest sum must be 64 hex digits, got {text!r}"
            ) from None
        return cls(samples, total)
