"""Test-case files as AscendC samples and CANN's operator test flow read them: raw little-endian ``.bin`` beside
``.npy``, and a ``manifest.json`` naming every file.

bfloat16 has no numpy dtype: its tensors are stored as their 16 bits (``uint16``, the manifest says
``"storage": "uint16 bits of bfloat16"``), which is also how an AscendC kernel's ``GlobalTensor<bfloat16_t>``
sees them. Reading maps the file (``np.memmap``) and checks its byte size against the manifest's shape and
dtype before anything is compared, so a case of millions of elements is read once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

#: Manifest dtype name -> (torch dtype, numpy storage dtype, little-endian).
DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "float32": (torch.float32, np.dtype("<f4")),
    "float16": (torch.float16, np.dtype("<f2")),
    "bfloat16": (torch.bfloat16, np.dtype("<u2")),
    "float64": (torch.float64, np.dtype("<f8")),
    "int32": (torch.int32, np.dtype("<i4")),
    "int64": (torch.int64, np.dtype("<i8")),
    "int16": (torch.int16, np.dtype("<i2")),
    "int8": (torch.int8, np.dtype("i1")),
    "uint8": (torch.uint8, np.dtype("u1")),
    "bool": (torch.bool, np.dtype("?")),
}
NAMES = {torch_dtype: name for name, (torch_dtype, _) in DTYPES.items()}
MANIFEST = "manifest.json"


class CaseFileError(ValueError):
    """A case directory or an actual-output file that cannot be used: the message is one line saying why."""


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name of a torch dtype (``"bfloat16"``, ...)."""
    try:
        return NAMES[dtype]
    except KeyError:
        raise CaseFileError(f"dtype {dtype} cannot be stored in a case file") from None


def storage(t: torch.Tensor) -> np.ndarray:
    """The little-endian numpy array of ``t``'s values as they are written (bfloat16: its bits as uint16)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).astype("<u2", copy=False)
    return t.numpy().astype(DTYPES[dtype_name(t.dtype)][1], copy=False)


def write(directory: Path, stem: str, t: torch.Tensor) -> dict:
    """Write ``stem.bin`` and ``stem.npy`` for ``t``; returns its manifest entry."""
    array = storage(t)
    array.tofile(directory / f"{stem}.bin")
    np.save(directory / f"{stem}.npy", array, allow_pickle=False)
    entry = {"name": stem, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "bin": f"{stem}.bin",
             "npy": f"{stem}.npy", "bytes": int(array.nbytes)}
    if t.dtype == torch.bfloat16:
        entry["storage"] = "uint16 bits of bfloat16"
    return entry


def read(path: Path, dtype: str, shape: list[int]) -> torch.Tensor:
    """The tensor in a ``.bin`` (raw little-endian) or ``.npy`` file, checked against ``dtype`` and ``shape``.

    Raises:
        CaseFileError: the file is missing, or its size / dtype / shape is not the expected one.
    """
    if dtype not in DTYPES:
        raise CaseFileError(f"{path}: unknown dtype {dtype!r} in the manifest")
    torch_dtype, np_dtype = DTYPES[dtype]
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if not os.path.isfile(path):
        raise CaseFileError(f"{path}: no such file")
    if count == 0 and not str(path).endswith(".npy"):
        if os.path.getsize(path):
            raise CaseFileError(f"{path}: {os.path.getsize(path)} bytes, expected 0 for {dtype} {list(shape)}")
        return torch.empty(shape, dtype=torch_dtype)
    if str(path).endswith(".npy"):
        array = np.load(path, mmap_mode="c", allow_pickle=False)  # copy-on-write: writable, read once
        if array.dtype.newbyteorder("<") != np_dtype.newbyteorder("<") or list(array.shape) != list(shape):
            raise CaseFileError(f"{path}: holds {array.dtype} {list(array.shape)}, expected {dtype} {list(shape)}"
                                + (" (as uint16 bits)" if dtype == "bfloat16" else ""))
    else:
        size = os.path.getsize(path)
        if size != count * np_dtype.itemsize:
            raise CaseFileError(f"{path}: {size} bytes, expected {count * np_dtype.itemsize} for {dtype} "
                                f"{list(shape)} ({np_dtype.itemsize} bytes each)")
        array = np.memmap(path, dtype=np_dtype, mode="c", shape=tuple(shape) if shape else (1,))
    native = np.ascontiguousarray(array).astype(np_dtype.newbyteorder("="), copy=False).reshape(shape)
    if dtype == "bfloat16":
        return torch.from_numpy(native.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(native).to(torch_dtype)


def write_manifest(directory: Path, manifest: dict) -> Path:
    path = directory / MANIFEST
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def read_manifest(directory: Path) -> dict:
    """``DIR/manifest.json``, with the keys every case has (``op``, ``inputs``, ``outputs``)."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CaseFileError(f"{directory}: no {MANIFEST} (write a case with `gradops golden OP --out DIR`)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CaseFileError(f"{path}: not JSON ({err.msg} at line {err.lineno})") from None
    missing = [k for k in ("op", "inputs", "outputs") if k not in manifest]
    if missing:
        raise CaseFileError(f"{path}: missing {', '.join(missing)}")
    return manifest
