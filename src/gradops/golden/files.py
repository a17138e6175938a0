"""Test-case files as AscendC samples and CANN's operator test flow read them: raw little-endian ``.bin`` beside
``.npy``, and a ``manifest.json`` naming every file.

bfloat16 has no numpy dtype: its tensors are stored as their 16 bits (``uint16``, the manifest says
``"storage": "uint16 bits of bfloat16"``), which is also how an AscendC kernel's ``GlobalTensor<bfloat16_t>``
sees them.

Nothing in a case directory or an output file is trusted (``gradops verify`` is pointed at directories it did not
write):

- the manifest is checked key by key (:func:`outputs`): types, dtype names, sizes >= 0;
- a file the manifest names must stay inside the case directory: no absolute path, no ``..``, no symlink that
  resolves outside it (:func:`case_file`);
- an output file is opened as a :class:`Stored`: its byte size must be exactly what the manifest's shape and dtype
  take (``.npy``: its header is parsed without unpickling, object arrays refused), and its values are read chunk by
  chunk, so a file of millions of elements - or a sparse file whose apparent size is far above what is on disk -
  costs a few chunks of memory, not its size.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
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
#: A manifest larger than this is not one gradops wrote (13 outputs, a few inputs: a few KiB).
MANIFEST_LIMIT = 1 << 20
#: Header bytes numpy itself reads at most before refusing an .npy (``np.load``'s default max_header_size).
NPY_HEADER_LIMIT = 10000


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


@dataclass(frozen=True)
class Stored:
    """A checked tensor file, read on demand: ``shape`` and ``dtype`` as the manifest says, the values at byte
    ``offset`` of ``path`` in ``file_dtype`` (the .npy's own byte order; a .bin's little-endian)."""
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    file_dtype: np.dtype
    offset: int

    def numel(self) -> int:
        """The number of elements."""
        return math.prod(self.shape)

    def chunk(self, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor, read from the file (a fresh CPU tensor).

        Raises:
            CaseFileError: the file changed under the reader (fewer bytes than checked).
        """
        count = max(0, min(stop, self.numel()) - start)
        with open(self.path, "rb") as f:
            f.seek(self.offset + start * self.file_dtype.itemsize)
            raw = np.fromfile(f, dtype=self.file_dtype, count=count)
        if raw.size != count:
            raise CaseFileError(f"{self.path}: shorter than checked (changed while being read)")
        native = raw.astype(self.file_dtype.newbyteorder("="), copy=False)
        if self.dtype == torch.bfloat16:
            return torch.from_numpy(native.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(native).to(self.dtype)

    def tensor(self) -> torch.Tensor:
        """The whole tensor, in :attr:`shape` (memory: its size; :meth:`chunk` reads a part)."""
        return self.chunk(0, self.numel()).reshape(self.shape)


def check_shape(shape: object, where: str) -> tuple[int, ...]:
    """A manifest shape: a list of integers >= 0 (not bools, not floats).

    Raises:
        CaseFileError: naming ``where`` and the value given.
    """
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise CaseFileError(f"{where}: shape must be a list of integers >= 0, got {_show(shape)}")
    return tuple(shape)


def check_dtype(dtype: object, where: str) -> str:
    """A manifest dtype name, one of :data:`DTYPES`.

    Raises:
        CaseFileError: naming ``where`` and the value given.
    """
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CaseFileError(f"{where}: dtype must be one of {', '.join(DTYPES)}, got {_show(dtype)}")
    return dtype


def _show(value: object) -> str:
    """``repr`` cut to one short line (a manifest value is not ours to print at length)."""
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 60 else text[:57] + "..."


def open_tensor(path: str | Path, dtype: str, shape: list[int] | tuple[int, ...]) -> Stored:
    """Check the ``.bin`` (raw little-endian) or ``.npy`` file at ``path`` against ``dtype`` and ``shape`` and
    return it as a :class:`Stored`; nothing but the .npy header is read.

    Raises:
        CaseFileError: the file is missing or not a regular file; its size, dtype or shape is not the expected
            one; an .npy that is malformed, truncated, Fortran-ordered, or holds Python objects (never unpickled).
    """
    path = Path(path)
    dtype = check_dtype(dtype, str(path))
    shape = check_shape(list(shape), str(path))
    torch_dtype, np_dtype = DTYPES[dtype]
    count = math.prod(shape)
    if not path.is_file():
        raise CaseFileError(f"{path}: no such file" if not path.exists() else f"{path}: not a regular file")
    size = os.path.getsize(path)
    bits = " (as uint16 bits)" if dtype == "bfloat16" else ""
    if path.suffix != ".npy":
        if size != count * np_dtype.itemsize:
            raise CaseFileError(f"{path}: {size} bytes, expected {count * np_dtype.itemsize} for {dtype} "
                                f"{list(shape)} ({np_dtype.itemsize} bytes each)")
        return Stored(path, torch_dtype, shape, np_dtype, 0)
    file_dtype, file_shape, offset = _npy_header(path)
    if file_dtype.newbyteorder("<") != np_dtype.newbyteorder("<") or list(file_shape) != list(shape):
        raise CaseFileError(f"{path}: holds {file_dtype} {list(file_shape)}, expected {dtype} {list(shape)}{bits}")
    if size != offset + count * np_dtype.itemsize:
        raise CaseFileError(f"{path}: {size - offset} bytes of data after its header, expected "
                            f"{count * np_dtype.itemsize} for {dtype} {list(shape)} (truncated or padded)")
    return Stored(path, torch_dtype, shape, file_dtype, offset)


def _npy_header(path: Path) -> tuple[np.dtype, tuple[int, ...], int]:
    """(dtype, shape, data offset) of an .npy file, parsed as numpy does (``ast.literal_eval``, no pickle)."""
    fmt = np.lib.format
    readers = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}
    try:
        with open(path, "rb") as f:
            version = fmt.read_magic(f)
            if version not in readers:
                raise ValueError(f"format version {version[0]}.{version[1]} (np.save writes 1.0 or 2.0)")
            shape, fortran, dtype = readers[version](f, max_header_size=NPY_HEADER_LIMIT)
            offset = f.tell()
    except (ValueError, SyntaxError, TypeError, EOFError) as err:
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CaseFileError(f"{path}: not a readable .npy file ({_show(message)[1:-1]})") from None
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise CaseFileError(f"{path}: an .npy of Python objects or records ({dtype}); refused, never unpickled")
    if fortran and sum(d > 1 for d in shape) > 1:
        raise CaseFileError(f"{path}: a Fortran-ordered .npy; save a C-ordered array (np.ascontiguousarray)")
    return dtype, tuple(shape), offset


def read(path: Path, dtype: str, shape: list[int]) -> torch.Tensor:
    """The tensor in a ``.bin`` (raw little-endian) or ``.npy`` file, checked against ``dtype`` and ``shape``
    (:func:`open_tensor`), read whole.

    Raises:
        CaseFileError: the file is missing, or its size / dtype / shape is not the expected one.
    """
    return open_tensor(path, dtype, shape).tensor()


def case_file(directory: Path, name: object, where: str) -> Path:
    """The path of a file a manifest names, refused unless it stays inside ``directory``: a relative name without
    ``..``, which, symlinks resolved, still lies under the directory (a manifest must not make ``gradops verify``
    read - and print values from - any file the user can read).

    Raises:
        CaseFileError: naming ``where`` and the value given.
    """
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CaseFileError(f"{where}: must be a file name in the case directory, got {_show(name)}")
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise CaseFileError(f"{where}: {name!r} leaves the case directory; a manifest names files inside it")
    path = directory / relative
    try:
        inside = path.resolve().is_relative_to(directory.resolve())
    except (OSError, RuntimeError):  # a symlink loop
        inside = False
    if not inside:
        raise CaseFileError(f"{where}: {name!r} resolves outside the case directory (a symlink); refused")
    return path


def write_manifest(directory: Path, manifest: dict) -> Path:
    path = directory / MANIFEST
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def read_manifest(directory: Path) -> dict:
    """``DIR/manifest.json``, with the keys every case has (``op`` a string, ``inputs`` and ``outputs`` lists).

    Raises:
        CaseFileError: no manifest, not JSON, not an object, a key missing or of the wrong type.
    """
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CaseFileError(f"{directory}: no {MANIFEST} (write a case with `gradops golden OP --out DIR`)")
    if path.stat().st_size > MANIFEST_LIMIT:
        raise CaseFileError(f"{path}: {path.stat().st_size} bytes; a case manifest is a few KiB")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise CaseFileError(f"{path}: not JSON ({err.msg} at line {err.lineno})") from None
    except (UnicodeDecodeError, RecursionError):
        raise CaseFileError(f"{path}: not JSON text") from None
    except OSError as err:
        raise CaseFileError(f"{path}: cannot be read ({err.strerror or err})") from None
    if not isinstance(manifest, dict):
        raise CaseFileError(f"{path}: must hold a JSON object, got {type(manifest).__name__}")
    missing = [k for k in ("op", "inputs", "outputs") if k not in manifest]
    if missing:
        raise CaseFileError(f"{path}: missing {', '.join(missing)}")
    if not isinstance(manifest["op"], str):
        raise CaseFileError(f"{path}: op must be a string, got {_show(manifest['op'])}")
    for key in ("inputs", "outputs"):
        if not isinstance(manifest[key], list):
            raise CaseFileError(f"{path}: {key} must be a list, got {_show(manifest[key])}")
    return manifest


def outputs(directory: Path, manifest: dict) -> list[dict]:
    """The manifest's outputs, each checked: ``name`` a string, ``dtype`` one of :data:`DTYPES`, ``shape`` a list
    of sizes >= 0, ``golden`` (and ``third_party`` where given) a file inside ``directory`` (:func:`case_file`).
    Returns one dict per output with those keys, the file names turned into paths (``third_party`` None where the
    case has none).

    Raises:
        CaseFileError: naming the output and key at fault.
    """
    checked = []
    if not manifest["outputs"]:
        raise CaseFileError(f"{directory / MANIFEST}: outputs is empty")
    for i, entry in enumerate(manifest["outputs"]):
        where = f"{directory / MANIFEST}: outputs[{i}]"
        if not isinstance(entry, dict):
            raise CaseFileError(f"{where} must be an object, got {_show(entry)}")
        absent = [k for k in ("name", "dtype", "shape", "golden") if k not in entry]
        if absent:
            raise CaseFileError(f"{where}: missing {', '.join(absent)}")
        if not isinstance(entry["name"], str):
            raise CaseFileError(f"{where}.name must be a string, got {_show(entry['name'])}")
        third = entry.get("third_party")
        checked.append({
            "name": entry["name"], "dtype": check_dtype(entry["dtype"], where),
            "shape": list(check_shape(entry["shape"], where)),
            "golden": case_file(directory, entry["golden"], f"{where}.golden"),
            "third_party": None if third is None else case_file(directory, third, f"{where}.third_party"),
        })
    return checked
