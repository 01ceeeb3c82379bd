"""Reading safetensors: one file, or a sharded set (an `*.safetensors.index.json` and its shards,
or a directory of .safetensors files), one tensor at a time straight from disk."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import mmap
import os
import pathlib
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, BinaryIO

import numpy as np

from qmill.checkpoints.base import buffers, dtypes, protocols, source_base
from qmill.checkpoints.formats.safetensors import header as header_lib


class _Location:
    __slots__ = ("begin", "data_start", "shape", "shard", "stored")

    def __init__(self, shard: int, data_start: int, info: dict[str, Any]) -> None:
        self.shard = shard
        self.data_start = data_start
        self.begin = info["data_offsets"][0]
        self.stored = header_lib.CODES[info["dtype"]]
        self.shape = tuple(info["shape"])


class SafetensorsSource(source_base.SourceBase):
    """Shards in order, tensors in file order within each shard."""

    format = "safetensors"
    # Reads are positional (no shared file offset): the pipeline may read kept tensors to write
    # them while a client's request thread reads the next tensors to send.
    concurrent_reads = True
    # How the source's own names nest, by convention ("model.layers.0.mlp.up_proj.weight"). The
    # parts qmill adds to a quantized leaf are always '/'-joined: P/array/qvalue.
    separator = "."
    # Whether read() maps tensors of MAP_MIN_BYTES or more (read-only views of the file's pages
    # in the page cache) instead of reading them into pooled buffers. For a caller that only
    # reads their bytes: the client sending them to a server skips the read's copy and, for a
    # buffer not yet in the pool, the kernel zeroing it (~0.3-0.7 of 1.5-2 CPU-s of a 805 MB
    # client run on the 2-core dev VM, bench/README.md issue 27). The engine in this process
    # wants a writable 64-byte aligned buffer of its own (XLA:CPU uses one in place; the data
    # in a file is 8-byte aligned), hence off by default. pipeline.quantize_checkpoint sets it.
    mapped = False

    def __init__(self, files: list[pathlib.Path], *, index: pathlib.Path | None = None) -> None:
        self.files = list(files)
        # Set when the checkpoint came as a sharded set: a writer given `like=` mirrors it.
        self.index = index
        self._handles: dict[int, BinaryIO] = {}
        self._watches: dict[int, _Watch | None] = {}
        self._opening = threading.Lock()
        # Tensors are read into buffers reused once the caller drops them (buffers.py).
        self._buffers = buffers.BufferPool()
        self._where: dict[str, _Location] = {}
        self._entries: list[protocols.TensorEntry] = []
        self.metadata: dict[str, str] = {}
        # One record for all shards: a tensor name is in exactly one of them.
        self._record = dtypes.Record()
        for shard, path in enumerate(self.files):
            tensors, metadata, data_start = header_lib.read_header(path)
            record = header_lib.read_record(path, metadata)
            if shard == 0:
                self.metadata = {
                    k: v for k, v in metadata.items() if k not in header_lib.RECORD_KEYS
                }
            for name, info in tensors.items():
                if name in self._where:
                    other = self.files[self._where[name].shard]
                    raise ValueError(f"tensor {name} is in both {other} and {path}")
                where = _Location(shard, data_start, info)
                self._where[name] = where
                if name in record.dtypes:
                    self._record.dtypes[name] = record.dtypes[name]
                if name in record.packed:
                    self._record.packed[name] = record.packed[name]
                dtype, shape = self._record.logical(name, where.stored, where.shape)
                self._entries.append(protocols.entry(name, dtype, shape))

    @property
    def sharded(self) -> bool:
        return self.index is not None or len(self.files) > 1

    def shard_of(self, path: str) -> int | None:
        """The index in `files` of the shard holding tensor `path` (None: not in this source)."""
        where = self._where.get(path)
        return None if where is None else where.shard

    def read(self, path: str) -> np.ndarray:
        try:
            where = self._where[path]
        except KeyError:
            raise KeyError(f"no tensor {path!r} in {self.files[0].parent}") from None
        nbytes = where.stored.itemsize * math.prod(where.shape)
        fd = self._handle(where.shard).fileno()
        offset = where.data_start + where.begin
        # Safetensors data is little-endian, as is every host qmill runs on (x86-64, arm64).
        watch = self._watch(where.shard) if self.mapped and nbytes >= MAP_MIN_BYTES else None
        if watch is not None and offset + nbytes <= os.fstat(fd).st_size:
            watch.check()
            array = _mapped(watch, offset, nbytes).view(where.stored).reshape(where.shape)
        else:
            array = self._buffers.take(nbytes).view(where.stored).reshape(where.shape)
            # Straight into the array's buffer: one copy of the tensor in memory, not two.
            buffer = memoryview(array.reshape(-1).view(np.uint8))
            if _read_at(fd, buffer, offset) != array.nbytes:
                raise ValueError(f"{self.files[where.shard]}: truncated data for tensor {path}")
        try:
            return self._record.restore(path, array)
        except ValueError as e:
            raise ValueError(f"{self.files[where.shard]}: {e}") from None

    def _watch(self, shard: int) -> _Watch | None:
        """The shard's lease-holding watch, made at its first mapped read; None where the
        shard cannot be leased (it is then read, not mapped)."""
        with self._opening:
            if shard not in self._watches:
                fd = self._handle_locked(shard).fileno()
                self._watches[shard] = _Watch.lease(fd, self.files[shard])
            return self._watches[shard]

    def _handle(self, shard: int) -> BinaryIO:
        with self._opening:  # two threads reading a shard first must not both open it
            return self._handle_locked(shard)

    def _handle_locked(self, shard: int) -> BinaryIO:
        if shard not in self._handles:
            self._handles[shard] = open(self.files[shard], "rb")  # noqa: SIM115 - close()
        return self._handles[shard]

    def close(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()
        for watch in self._watches.values():
            if watch is not None:
                watch.release()
        self._watches.clear()
        self._buffers.release()


# Smaller tensors are read: a mapping costs a system call and a page-table entry per page.
MAP_MIN_BYTES = 1 << 20


class SourceChanged(ValueError):
    """The source file was truncated or rewritten while tensors mapped from it were in use."""


class _Watch:
    """One shard's file while tensors are mapped from it, under a read lease.

    Touching a mapped page past the end of a file that shrank kills the process with SIGBUS,
    which Python cannot catch. A read lease (fcntl F_SETLEASE) closes that window: whoever opens
    the file to write or truncate it waits (up to /proc/sys/fs/lease-break-time, 45 s by
    default) until the lease is dropped: when the source is closed (release) or this watch's
    descriptor and every mapping made under it are gone. Meanwhile check() sees the break and raises
    SourceChanged; a sender checks before it touches a mapped tensor's pages again
    (unchanged_check). A file the lease cannot be taken on (another process has it open for
    writing, it belongs to another user, a file system without leases) is read, not mapped.
    """

    def __init__(self, fd: int, path: pathlib.Path) -> None:
        self._fd = fd
        self.path = path
        st = os.fstat(fd)
        self._stamp = (st.st_ino, st.st_size, st.st_mtime_ns)

    @classmethod
    def lease(cls, fd: int, path: pathlib.Path) -> _Watch | None:
        own = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC) if _LEASES else -1
        if own < 0:
            return None
        try:
            # A lease break is announced by a signal (SIGIO, whose default kills the process):
            # SIGURG's default is to ignore it. check() asks the kernel instead.
            fcntl.fcntl(own, fcntl.F_SETSIG, signal.SIGURG)
            fcntl.fcntl(own, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        except OSError as e:
            os.close(own)
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EPERM, errno.EINVAL, errno.ENOLCK):
                return None
            raise
        return cls(own, path)

    def check(self) -> None:
        """Raises SourceChanged once the file is being truncated or written (a lease break is
        pending), or was since it was opened."""
        st = os.fstat(self._fd)
        breaking = fcntl.fcntl(self._fd, fcntl.F_GETLEASE) != fcntl.F_RDLCK
        if breaking or (st.st_ino, st.st_size, st.st_mtime_ns) != self._stamp:
            raise SourceChanged(
                f"{self.path} changed while it was being read (truncated or rewritten); "
                "nothing was written under the output's name"
            )

    def release(self) -> None:
        """Lets a writer waiting on the lease go ahead (the source is closed: its reader is
        done; an array mapped under the watch is then the caller's to keep from touching)."""
        with contextlib.suppress(OSError):
            fcntl.fcntl(self._fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)

    def __del__(self) -> None:
        os.close(self._fd)


# Leases and /proc/self/fd are Linux's.
_LEASES = sys.platform.startswith("linux")


class _Mapping(mmap.mmap):
    """A mapping that knows the watch it was made under (unchanged_check finds it)."""

    watch: _Watch


def _mapped(watch: _Watch, offset: int, nbytes: int) -> np.ndarray:
    """A read-only uint8 view of `nbytes` of the watched file at `offset`, mapped (the caller
    checked the file is that long). The mapping, and with it the watch and its lease, lives as
    long as the array and its views."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    mapping = _Mapping(
        watch._fd, offset + nbytes - start, mmap.MAP_SHARED, mmap.PROT_READ, offset=start
    )
    mapping.watch = watch
    mapping.madvise(mmap.MADV_WILLNEED)  # read ahead now if the pages are not cached
    return np.frombuffer(mapping, np.uint8, nbytes, offset - start)


def _no_check() -> None:
    pass


def unchanged_check(array: np.ndarray) -> Callable[[], None]:
    """For an array mapped from a file (or a view of one): its watch's check, to call before
    each touch of its pages, and once after the last (a change meanwhile is then an error,
    never bytes of the changed file). For any other array, a check that passes."""
    base: object = array
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return base.watch.check if isinstance(base, _Mapping) else _no_check


def _read_at(fd: int, buffer: memoryview, offset: int) -> int:
    """Fills `buffer` from `offset` of `fd` without moving a shared file position; returns the
    bytes read (fewer at the end of the file). Linux reads at most ~2 GiB per call."""
    done = 0
    while done < len(buffer):
        n = os.preadv(fd, [buffer[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def open_index(index: pathlib.Path) -> SafetensorsSource:
    """A sharded set from its index: the shards its weight_map names, in name order."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index} is not a safetensors index (no weight_map: {e})") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} is not a safetensors index (empty or malformed weight_map)")
    names = sorted(set(weight_map.values()))
    files = [index.parent / name for name in names]
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"shard {file} named by {index} does not exist")
    source = SafetensorsSource(files, index=index)
    for name, shard in weight_map.items():
        found = source.shard_of(name)
        if found is None or files[found].name != shard:
            source.close()
            raise ValueError(f"{index} puts tensor {name} in {shard}, which does not hold it")
    return source
