"""The NVMe tier's files, one per name: their names and their page-aligned ``.npy`` layout.

A file is a ``.npy`` (format 1.0, ``np.load`` reads it) whose header is padded with spaces to a whole
number of pages, so that the array's data starts on a page, followed by the data padded with zeros
to a whole page: every read and write of the data is page-aligned in the file, in memory
(``rates.page_aligned``) and in length, as ``O_DIRECT`` needs. Files ``np.save`` wrote (a 128-byte
header) are read too, without ``O_DIRECT``.

A name's file is ``<name>.npy`` with every character but ``A-Za-z0-9_.-`` (and a leading ``.``)
escaped as ``%XX`` of its UTF-8 bytes, so the name is read back from the file name; a name whose
escaped form is longer than ``LONG`` characters is cut and marked ``~<sha1 of the name>``.

``open_file`` opens with ``O_DIRECT`` where the filesystem allows it (the page cache bypassed: the
disk's own speed, as DeepNVMe's libaio engine does, Rajbhandari et al. 2021, Sec. 6.2), else without
(tmpfs, some network filesystems refuse it with ``EINVAL``).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import math
import os
import struct
import urllib.parse
from dataclasses import dataclass, field

import numpy as np

from minipar.npy import HEADER

PAGE = 4096  # bytes: the alignment O_DIRECT needs here (a multiple of the disk's logical block)
LONG = 200  # longest escaped name kept whole in a file name (a file name has at most 255 bytes)
MAGIC = b"\x93NUMPY\x01\x00"


def round_up(nbytes: int, to: int = PAGE) -> int:
    """``nbytes`` rounded up to a multiple of ``to``."""
    return -(-nbytes // to) * to


def page_aligned(nbytes: int) -> np.ndarray:
    """A zeroed uint8 array of ``round_up(nbytes)`` bytes whose data starts on a page boundary."""
    size = round_up(nbytes)
    raw = np.zeros(size + PAGE, np.uint8)
    start = -raw.ctypes.data % PAGE
    return raw[start:start + size]


def resident(array: np.ndarray) -> np.ndarray:
    """``array`` (new, contiguous memory) with each of its pages written once, so that a move into it
    pays no first-touch page faults: the memory allocated and mapped beforehand, as DeepSpeed's
    pinned buffers are and a GPU's allocator hands out, the allocator's cost, not the move's."""
    flat = array.ravel(order="K").view(np.uint8)
    if flat.size:
        flat[::PAGE] = 0
        flat[-1] = 0
    return array


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged writer may still use on ``directory``'s filesystem (``os.statvfs``)."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def open_file(path: str, flags: int, direct: bool = True) -> tuple[int, bool]:
    """``(fd, direct)``: ``path`` opened with ``flags`` and ``O_DIRECT`` when ``direct`` and the
    filesystem allows it (``EINVAL`` otherwise: opened again without)."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o644), False


@dataclass(frozen=True)
class Layout:
    """Where an array lies in its file: its data from ``offset``, ``nbytes`` long, as ``dtype`` of
    ``shape`` in Fortran order or not. ``aligned``: the data starts on a page (``O_DIRECT`` possible)."""

    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]
    fortran: bool
    nbytes: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", math.prod(self.shape) * self.dtype.itemsize)

    @property
    def aligned(self) -> bool:
        return self.offset % PAGE == 0

    @property
    def file_bytes(self) -> int:
        """The file's size as this tier writes it: the padded header and the padded data."""
        return self.offset + round_up(self.nbytes)

    def array(self, raw: np.ndarray) -> np.ndarray:
        """The array whose bytes begin ``raw`` (no copy)."""
        return raw[:self.nbytes].view(self.dtype).reshape(self.shape, order="F" if self.fortran else "C")


def layout_of(array: np.ndarray) -> tuple[Layout, bytes]:
    """The layout this tier gives ``array``'s file, and its header (a whole number of pages)."""
    return _layout(array.dtype, tuple(array.shape), bool(array.flags.f_contiguous and not array.flags.c_contiguous))


@functools.lru_cache(maxsize=4096)  # a step writes the same few shapes again and again
def _layout(dtype: np.dtype, shape: tuple[int, ...], fortran: bool) -> tuple[Layout, bytes]:
    text = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": fortran,
                 "shape": shape}).encode("latin1")
    offset = round_up(len(MAGIC) + 2 + len(text) + 1)
    if offset - len(MAGIC) - 2 > 0xFFFF:
        raise ValueError(f"an array of {len(shape)} dimensions has too long a .npy header")
    head = MAGIC + struct.pack("<H", offset - len(MAGIC) - 2) + text + b" " * (offset - len(MAGIC) - 3 - len(text))
    return Layout(offset, dtype, shape, fortran), head + b"\n"


def padded(array: np.ndarray) -> np.ndarray | None:
    """``array``'s memory (contiguous) as a uint8 array of whole pages when it starts on a page and the
    allocation it lies in extends to the next page boundary past it (``page_aligned`` memory); else None."""
    if not (array.flags.c_contiguous or array.flags.f_contiguous) or array.ctypes.data % PAGE:
        return None
    root = array
    while isinstance(root.base, np.ndarray):
        root = root.base
    start = array.ctypes.data - root.ctypes.data
    if not root.flags.c_contiguous or start < 0 or start + round_up(array.nbytes) > root.nbytes:
        return None
    return root.reshape(-1).view(np.uint8)[start:start + round_up(array.nbytes)]


def data_bytes(array: np.ndarray, layout: Layout) -> np.ndarray:
    """``array``'s bytes in its layout's order as a page-aligned uint8 array of whole pages: ``array``'s
    own memory when it lies in ``page_aligned`` memory (``padded``), else a copy."""
    own = padded(array)
    if own is not None:
        return own
    flat = np.ravel(array, order="F" if layout.fortran else "C").view(np.uint8)
    out = page_aligned(flat.size)
    out[:flat.size] = flat
    return out


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype | type = np.float32) -> np.ndarray:
    """An array of ``shape`` and ``dtype`` (zeros) in ``page_aligned`` memory: written from and read into
    by the NVMe tier without a copy (DeepNVMe's pinned buffers)."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    return page_aligned(nbytes)[:nbytes].view(dtype).reshape(shape)


def aligned_copy(array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(copy, raw)``: a copy of ``array`` (its order kept when Fortran-contiguous) in ``raw``, page-aligned
    memory of whole pages (``data_bytes`` without a second copy)."""
    layout, _ = layout_of(array)
    raw = page_aligned(layout.nbytes)
    copy = layout.array(raw)
    np.copyto(copy, array)
    return copy, raw


def read_layout(path: str) -> Layout:
    """The layout of the ``.npy`` file at ``path`` from its header (parsed under ``minipar.npy.HEADER``:
    ``ast`` is not thread-safe in CPython 3.11)."""
    with open(path, "rb") as fh, HEADER:
        version = np.lib.format.read_magic(fh)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(fh)
        return Layout(fh.tell(), np.dtype(dtype), tuple(shape), bool(fortran))


def check_file(path: str) -> Layout:
    """The layout of the ``.npy`` file at ``path``; ``OSError`` naming it if its header is unreadable or
    its size is neither the header's plus the array's nor that padded to a page (this tier's)."""
    try:
        layout = read_layout(path)
        size = os.path.getsize(path)
    except (OSError, ValueError) as exc:
        raise OSError(f"NVMe file {path} is unreadable: {exc}") from exc
    have, nbytes = size - layout.offset, layout.nbytes
    if have < nbytes:
        raise OSError(f"NVMe file {path} is truncated: {have} of {nbytes} array bytes on disk")
    if have not in (nbytes, round_up(nbytes)):
        raise OSError(f"NVMe file {path} has {have - nbytes} bytes after its {nbytes} array bytes")
    return layout


def file_name(name: str) -> str:
    """The file name of ``name`` (see the module docstring)."""
    if not name:
        raise ValueError("an NVMe name must not be empty")
    enc = urllib.parse.quote(name, safe="").replace("~", "%7E")
    if enc.startswith("."):
        enc = "%2E" + enc[1:]
    if len(enc) > LONG:
        enc = f"{enc[:LONG - 41]}~{hashlib.sha1(name.encode()).hexdigest()}"
    return enc + ".npy"


def name_of(fname: str) -> str | None:
    """The name whose file is ``fname``; None for a cut (``~``) name or a file this tier does not name."""
    if not fname.endswith(".npy") or "~" in fname:
        return None
    try:
        name = urllib.parse.unquote(fname[:-4], errors="strict")
    except UnicodeDecodeError:
        return None
    return name if name and file_name(name) == fname else None
