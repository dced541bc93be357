"""Sharded checkpoints: every rank writes its own shards, one metadata file says what they are, the
whole directory appears atomically, and it loads at any world size (the shards are re-cut).

A sharded state is a set of named flat 1-D arrays (``"unit3/param"``, ``"unit3/exp_avg"``,
``"bucket0/master"``), each logically ``numel`` elements, zero-padded to ``L = ceil(numel/N) N`` and
cut evenly: rank r holds ``[r L/N, (r+1) L/N)`` (the layout of ``flat.py``). A checkpoint directory::

    ckpt/meta.json        world size N, every array's name, numel and dtype, each file's sha256,
                          and the caller's replicated ``meta`` (step, loss scale, ...)
    ckpt/rank00000.npz    rank 0's shards, ``arr_0, arr_1, ...`` in the order of meta.json's names
    ...
    ckpt/rank0000{N-1}.npz

Saving (DeepSpeed and PyTorch DCP also write one file per rank plus metadata; the atomic rename is
the classic write-then-rename of POSIX ``rename(2)``):

1. every rank checks its arguments and ``allgather_object`` compares names, numels, dtypes, the
   directory and ``meta`` on all ranks: any problem is the same ``ValueError`` on every rank;
2. rank 0 finishes an earlier interrupted commit (below), deletes leftovers of earlier crashed
   saves, refuses to replace a ``ckpt`` holding anything but checkpoint files, and makes
   ``ckpt.tmp-X`` (X: 12 fresh hex digits); every rank writes its file there (fsynced);
3. the ranks ``allgather_object`` their files' checksums, so every file is complete before
4. rank 0 writes ``meta.json`` (as ``meta.json.part``, fsync, rename: a ``meta.json`` present is
   a complete one), then commits: rename ``ckpt`` -> ``ckpt.old-X``, rename ``ckpt.tmp-X`` ->
   ``ckpt``, delete ``ckpt.old-X``; and broadcasts success, so no rank returns before the commit.

Crash windows (a rank dies; nothing is cleaned up):

- in steps 1-3 or before the first rename: ``ckpt`` is untouched (the old checkpoint);
  ``ckpt.tmp-X`` is a leftover the next save deletes;
- between the two renames: there is no ``ckpt``, but ``ckpt.old-X`` exists, so the commit had
  started, and ``ckpt.tmp-X/meta.json`` exists, so the new checkpoint is complete. ``load`` and
  ``consolidate`` read ``ckpt.tmp-X`` (roll forward, without writing); the next ``save`` renames it
  into place first. (Were ``meta.json`` missing, which the order above rules out, they would read
  ``ckpt.old-X``, the old one: roll back);
- after the second rename: ``ckpt`` is the new checkpoint; ``ckpt.old-X`` is a leftover.

A step that fails without a crash (an ``OSError``: disk full, permissions) is undone (``ckpt``
renamed back if it had been moved, ``ckpt.tmp-X`` deleted) and is the same ``ValueError`` on
every rank.

So ``ckpt`` is, as ``load`` sees it, always the old complete checkpoint or the new complete one.
Not supported: two jobs saving to one directory at once, or a save concurrent with a load.
All ranks must see one filesystem (threads, or ``mpiexec`` on one machine / a shared mount).

Loading at N' ranks: rank r' needs elements ``[r' L'/N', (r'+1) L'/N')`` of each array, and reads
only the old files that hold some of those elements (never the whole array). It checks every
file it reads against its sha256 (files no rank needs, those holding only padding, are checked
round-robin), and the ranks agree on the outcome before anything is returned: a missing or
corrupted file, or arrays not matching ``numels``, is the same ``ValueError`` on every rank.
Padding comes back as zeros.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import secrets
import shutil
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from minipar.comm.errors import PeerLost
from minipar.npy import HEADER

FORMAT, VERSION = "minipar.zero.checkpoint", 1
META = "meta.json"
KINDS = "biufc"  # bool, signed, unsigned, float, complex: what a shard may hold
OURS = re.compile(r"meta\.json(\.part)?|rank\d{5,}\.npz")  # the files a checkpoint directory may hold


def file_name(rank: int) -> str:
    """The shard file of ``rank``: ``rank00003.npz``."""
    return f"rank{rank:05d}.npz"


def shard_range(numel: int, world: int, rank: int) -> tuple[int, int]:
    """``rank``'s elements ``[lo, hi)`` of an array of ``numel`` padded to a multiple of ``world``."""
    size = -(-numel // world)
    return rank * size, (rank + 1) * size


# ---- file system steps (module level so tests can simulate a crash at each) ----------------------
def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _read_file(path: Path) -> bytes:
    return path.read_bytes()


def _rename(src: Path, dst: Path) -> None:
    """One of the commit's renames (atomic on POSIX), then the parent made durable."""
    os.rename(src, dst)
    _fsync_dir(dst.parent)


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # a platform without directory file descriptors
        pass


def _siblings(directory: Path, kind: str) -> list[Path]:
    """``directory``'s ``.tmp-X`` or ``.old-X`` siblings (X: 12 hex digits, as ``save`` makes them)."""
    pattern = re.compile(re.escape(f"{directory.name}.{kind}-") + "[0-9a-f]{12}")
    if not directory.parent.is_dir():
        return []
    return sorted(p for p in directory.parent.iterdir() if pattern.fullmatch(p.name))


def _check_replaceable(directory: Path) -> None:
    """Refuse to replace (and so delete) a ``directory`` that holds anything but checkpoint files."""
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory} is a file, not a checkpoint; refusing to replace it")
    other = sorted(p.name for p in directory.iterdir() if not OURS.fullmatch(p.name)) if directory.exists() else []
    if other:
        raise ValueError(f"{directory} holds {other[:3]}, so it is not a checkpoint; refusing to replace it")


def _resolve(directory: Path) -> Path:
    """Where the checkpoint of ``directory`` is: itself, or after a crash between the commit's two
    renames the new ``.tmp-X`` (complete: it has ``meta.json``) or else the old ``.old-X``."""
    if directory.exists():
        return directory
    for old in _siblings(directory, "old"):
        new = directory.parent / f"{directory.name}.tmp-{old.name.rsplit('-', 1)[1]}"
        return new if (new / META).is_file() else old
    raise ValueError(f"no checkpoint at {directory}")


def _recover(directory: Path) -> None:
    """Make ``_resolve``'s answer physical (rename it to ``directory``) and delete the leftovers of
    interrupted saves. Rank 0 only, at the start of ``save``."""
    if not directory.exists() and _siblings(directory, "old"):
        _rename(_resolve(directory), directory)
    for p in _siblings(directory, "tmp") + _siblings(directory, "old"):
        _remove_tree(p)


def _roll_back(directory: Path, tmp: Path) -> None:
    """After a failed (not crashed) commit: the old checkpoint back in place, the new one deleted."""
    old = directory.parent / f"{directory.name}.old-{tmp.name.rsplit('-', 1)[1]}"
    if not directory.exists() and old.exists():
        _rename(old, directory)
    _remove_tree(tmp)


# ---- agreement ----------------------------------------------------------------------------------
def _agree(comm: Any, errors: list[str], what: str, extra: Any = None) -> list[Any]:
    """Allgather every rank's ``(errors, extra)``; the same ``ValueError`` on every rank if any
    rank has an error (messages in rank order, duplicates once). Returns every rank's ``extra``."""
    table = comm.allgather_object((errors, extra))
    _raise_if(what, [e for errs, _ in table for e in errs])
    return [x for _, x in table]


def _raise_if(what: str, errors: list[str]) -> None:
    if errors:
        raise ValueError(f"{what}: " + "; ".join(dict.fromkeys(errors)))


def _local_problem(fn: Any, *args: Any) -> tuple[Any, list[str]]:
    """``fn(*args)`` and no error, or None and the message of the ``ValueError``/``OSError`` it raised."""
    try:
        return fn(*args), []
    except (ValueError, OSError) as exc:
        return None, [str(exc)]


# ---- save ---------------------------------------------------------------------------------------
def _plain(x: Any) -> Any:
    """A numpy scalar as the Python number JSON can hold (the ``default`` of ``json.dumps``)."""
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"{type(x).__name__} {x!r} is not JSON-serializable")


def _check_save(shards: Any, numels: Any, meta: Any, world: int) -> tuple[list[str], Any, list[str]]:
    """The sorted names, ``meta`` as ``load`` will return it (through JSON), and this rank's problems
    with the arguments of ``save``."""
    errors: list[str] = []
    if not isinstance(shards, dict) or not isinstance(numels, dict):
        return [], None, ["shards and numels must be dicts keyed by array name"]
    if set(shards) != set(numels):
        errors.append(f"shards and numels name different arrays: {sorted(set(shards) ^ set(numels), key=str)}")
    names = sorted(n for n in shards if n in numels and isinstance(n, str) and n)
    if len(names) != len(shards):
        errors.append("array names must be non-empty strings")
    for name in names:
        a, n = shards[name], numels[name]
        if not isinstance(n, int | np.integer) or isinstance(n, bool) or n < 0:
            errors.append(f"{name!r}: numel must be a non-negative int, got {n!r}")
        elif not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.kind not in KINDS:
            errors.append(f"{name!r}: a shard must be a 1-D numeric numpy array, got "
                          f"{getattr(a, 'shape', type(a).__name__)} {getattr(a, 'dtype', '')}")
        elif a.size != -(-int(n) // world):
            errors.append(f"{name!r}: shard has {a.size} elements, but numel {n} over {world} ranks "
                          f"needs {-(-int(n) // world)}")
    try:
        if not isinstance(meta, dict):
            raise TypeError(f"got {type(meta).__name__}")
        meta = json.loads(json.dumps(meta, default=_plain))
    except (TypeError, ValueError) as exc:
        errors.append(f"meta must be a JSON-serializable dict: {exc}")
    return names, meta, errors


def save(directory: str | os.PathLike[str], comm: Any, shards: dict[str, np.ndarray], numels: dict[str, int],
         meta: dict[str, Any] | None = None) -> None:
    """Write this rank's ``shards`` (name -> flat 1-D shard, ``ceil(numel/N)`` elements) into the
    checkpoint ``directory``, replacing the previous one atomically (see the module docstring).

    Call on every rank of ``comm`` with the same names, ``numels``, dtypes and ``meta`` (small,
    replicated, JSON-serializable; numpy scalars are stored as Python numbers, exactly, and ``load``
    returns ``meta`` as JSON gives it back: tuples as lists, keys as strings). Raises the same
    ``ValueError`` on every rank if the arguments disagree or a file cannot be written; ``directory``
    is then unchanged.
    """
    directory = Path(directory).absolute()
    meta = {} if meta is None else meta
    what = f"save {directory}"
    names, meta, errors = _check_save(shards, numels, meta, comm.size)
    signature = None if errors else (str(directory), [(n, int(numels[n]), shards[n].dtype.str) for n in names],
                                     json.dumps(meta, sort_keys=True))
    table = _agree(comm, errors, what, signature)
    if any(s != table[0] for s in table):
        diff = [r for r, s in enumerate(table) if s != table[0]]
        raise ValueError(f"{what}: ranks {diff} differ from rank 0 in directory, array names, numels, dtypes "
                         "or meta; every rank must pass the same")

    # rank 0 prepares an empty temporary sibling
    tmp, errors = None, []
    if comm.rank == 0:
        def prepare() -> Path:
            _recover(directory)
            _check_replaceable(directory)
            path = directory.parent / f"{directory.name}.tmp-{secrets.token_hex(6)}"
            path.mkdir(parents=True)
            return path

        tmp, errors = _local_problem(prepare)
    made = tmp  # rank 0: the directory it made (None elsewhere, or if prepare failed)

    # every rank writes its file
    def write() -> tuple[str, str]:
        buf = io.BytesIO()
        np.savez(buf, *[np.ascontiguousarray(shards[n]) for n in names])
        data = buf.getvalue()
        _write_file(tmp / file_name(comm.rank), data)
        return file_name(comm.rank), hashlib.sha256(data).hexdigest()

    try:  # from the moment rank 0 made the directory: a peer lost in the broadcast too leaves none
        tmp, errors = comm.broadcast_object((tmp, errors))
        _raise_if(what, errors)
        mine, errors = _local_problem(write)
        files = _agree(comm, errors, what, mine)
    except (ValueError, PeerLost):  # a peer failed, or died before its file was complete: no commit
        if made is not None:
            _remove_tree(made)
        raise

    # rank 0 writes meta.json and commits
    if comm.rank == 0:
        doc = {"format": FORMAT, "version": VERSION, "world_size": comm.size,
               "arrays": [{"name": n, "numel": int(numels[n]), "dtype": shards[n].dtype.str} for n in names],
               "files": dict(files), "meta": meta}

        def commit() -> None:
            _write_file(tmp / (META + ".part"), json.dumps(doc, indent=1).encode())
            os.replace(tmp / (META + ".part"), tmp / META)
            _fsync_dir(tmp)
            old = directory.parent / f"{directory.name}.old-{tmp.name.rsplit('-', 1)[1]}"
            if directory.exists():
                _rename(directory, old)
            _rename(tmp, directory)
            _remove_tree(old)

        _, errors = _local_problem(commit)
        if errors:  # failed before the second rename completed: put the old one back
            _local_problem(_roll_back, directory, tmp)
    _raise_if(what, comm.broadcast_object(errors))


# ---- load ---------------------------------------------------------------------------------------
def _read_meta(directory: Path) -> tuple[Path, dict[str, Any]]:
    """The resolved checkpoint folder and its checked ``meta.json``."""
    where = _resolve(directory)
    try:
        doc = json.loads(_read_file(where / META))
    except FileNotFoundError:
        raise ValueError(f"{META}: missing in {where}") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{META}: unreadable ({exc})") from None
    try:
        n = doc["world_size"]
        ok = doc["format"] == FORMAT and doc["version"] == VERSION and isinstance(n, int) and n >= 1
        ok = ok and set(doc["files"]) == {file_name(r) for r in range(n)} and isinstance(doc["meta"], dict)
        ok = ok and all(isinstance(a["name"], str) and isinstance(a["numel"], int) and a["numel"] >= 0
                        and np.dtype(a["dtype"]).kind in KINDS for a in doc["arrays"])
    except (KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise ValueError(f"{META}: not a {FORMAT} version {VERSION} file")
    return where, doc


def _read_shard(where: Path, fname: str, sha256: str, arrays: list[dict[str, Any]], world: int,
                keep: set[int]) -> dict[int, np.ndarray]:
    """Arrays ``keep`` (indices into ``arrays``) of the old shard file ``fname``, checked."""
    try:
        data = _read_file(where / fname)
    except FileNotFoundError:
        raise ValueError(f"{fname}: missing") from None
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise ValueError(f"{fname}: corrupted (sha256 {got[:16]}..., {META} says {sha256[:16]}...)")
    try:  # a file whose checksum matches is well-formed unless meta.json lies; np.load's errors, named
        with HEADER, np.load(io.BytesIO(data), allow_pickle=False) as npz:  # rank threads load at once
            count, out = len(npz.files), {i: npz[f"arr_{i}"] for i in sorted(keep)}
    except (KeyError, OSError, EOFError, ValueError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{fname}: unreadable ({exc})") from None
    if count != len(arrays):
        raise ValueError(f"{fname}: holds {count} arrays, {META} names {len(arrays)}")
    for i, a in out.items():
        spec = arrays[i]
        if a.shape != (-(-spec["numel"] // world),) or a.dtype != np.dtype(spec["dtype"]):
            raise ValueError(f"{fname}: {spec['name']!r} is {a.shape} {a.dtype}, {META} says "
                             f"{spec['numel']} elements over {world} ranks, {spec['dtype']}")
    return out


def _files_of(arrays: list[dict[str, Any]], old: int, new: int, rank: int) -> dict[int, set[int]]:
    """Old file index -> the arrays that ``rank`` of ``new`` needs from it."""
    need: dict[int, set[int]] = {}
    for i, a in enumerate(arrays):
        lo, hi = shard_range(a["numel"], new, rank)
        hi, size = min(hi, a["numel"]), -(-a["numel"] // old)
        for f in range(lo // size, (hi - 1) // size + 1) if lo < hi else ():
            need.setdefault(f, set()).add(i)
    return need


def _check_numels(arrays: list[dict[str, Any]], numels: dict[str, int] | None) -> list[str]:
    if numels is None:
        return []
    have = {a["name"]: a["numel"] for a in arrays}
    errors = [f"{n!r} is not in the checkpoint" for n in sorted(set(numels) - set(have))]
    errors += [f"the checkpoint has {n!r}, not expected" for n in sorted(set(have) - set(numels))]
    errors += [f"{n!r} has {have[n]} elements in the checkpoint, expected {numels[n]}"
               for n in sorted(set(have) & set(numels)) if have[n] != numels[n]]
    return errors


def load(directory: str | os.PathLike[str], comm: Any,
         numels: dict[str, int] | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """This rank's shards for ``comm.size`` ranks (re-cut if the checkpoint was saved at another
    world size) and the saved ``meta``. Call on every rank.

    ``numels`` (optional): the arrays the caller expects (name -> numel); any difference is refused.
    A missing or corrupted file or a mismatch is the same ``ValueError`` on every rank, naming the
    file or the array, before any rank returns.
    """
    directory = Path(directory).absolute()
    what = f"load {directory}"
    found, errors = None, []
    if comm.rank == 0:
        found, errors = _local_problem(_read_meta, directory)
    found, errors = comm.broadcast_object((found, errors))
    _raise_if(what, errors)
    where, doc = found
    arrays, old = doc["arrays"], doc["world_size"]
    errors = _check_numels(arrays, numels)
    shards: dict[str, np.ndarray] = {}
    if not errors:
        need = [_files_of(arrays, old, comm.size, r) for r in range(comm.size)]
        mine = dict(need[comm.rank])
        unread = [f for f in range(old) if not any(f in n for n in need)]
        for f in unread[comm.rank::comm.size]:  # padding-only files: checked by someone all the same
            mine.setdefault(f, set())
        for a in arrays:
            lo, hi = shard_range(a["numel"], comm.size, comm.rank)
            shards[a["name"]] = np.zeros(hi - lo, dtype=np.dtype(a["dtype"]))
        for f in sorted(mine):
            fname = file_name(f)
            got, errs = _local_problem(_read_shard, where, fname, doc["files"][fname], arrays, old, mine[f])
            errors += errs
            for i, part in (got or {}).items():
                numel, out = arrays[i]["numel"], shards[arrays[i]["name"]]
                lo, hi = shard_range(numel, comm.size, comm.rank)
                olo, ohi = shard_range(numel, old, f)
                a, b = max(lo, olo), min(hi, ohi, numel)
                out[a - lo:b - lo] = part[a - olo:b - olo]
    _agree(comm, errors, what)
    return shards, doc["meta"]


def consolidate(directory: str | os.PathLike[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The full unpadded arrays of the checkpoint and its ``meta``, in one process (no communicator).
    Every file is checked; a missing or corrupted one is a ``ValueError`` naming it."""
    directory = Path(directory).absolute()
    what = f"consolidate {directory}"
    found, errors = _local_problem(_read_meta, directory)
    _raise_if(what, errors)
    where, doc = found
    arrays, world = doc["arrays"], doc["world_size"]
    parts: list[dict[int, np.ndarray]] = []
    for f in range(world):
        got, errs = _local_problem(_read_shard, where, file_name(f), doc["files"][file_name(f)], arrays, world,
                                   set(range(len(arrays))))
        errors += errs
        parts.append(got or {})
    _raise_if(what, errors)
    full = {a["name"]: np.concatenate([p[i] for p in parts])[:a["numel"]] for i, a in enumerate(arrays)}
    return full, doc["meta"]


def state_dict(directory: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Every parameter whole, by name, from a ZeRO or FSDP checkpoint, for single-process use
    (``nn.Module.load_state_dict``): the ``<group>/param`` arrays cut by the parameter names and
    shapes the trainer saved in ``meta["params"]``."""
    full, meta = consolidate(directory)
    out = {}
    for group, params in meta["params"].items():
        flat, offset = full[f"{group}/param"], 0
        for name, shape in params:
            n = int(np.prod(shape, dtype=np.int64))
            out[name] = flat[offset:offset + n].reshape(shape).copy()
            offset += n
    return out
