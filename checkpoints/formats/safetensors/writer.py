"""Writing safetensors: one file, or shards with a `model.safetensors.index.json`.

Destination: a path ending in `.safetensors` is one file. Any other path is a directory in the
Hugging Face layout: `model.safetensors`, or `model-00001-of-0000N.safetensors` ... plus
`model.safetensors.index.json` when sharded. The output is sharded when `like` is a sharded
safetensors source (output shard i holds what came from input shard i) or, otherwise, when
`max_shard_bytes` is set (a new shard starts before a tensor that would overflow the current one).

Memory and I/O: a safetensors header precedes the data but is known only at the end, so each
shard's tensors are appended to a staging file as they arrive, behind space reserved for the
header. When `like` tells which tensors will come (a quantized leaf P becomes at most three
tensors P/array/*), the reservation is sized from its entries and commit writes the header in
place, padded with spaces as the format allows. Otherwise, or when the header outgrows the space,
commit copies the data behind the header in the kernel. Neither path holds more than the tensor
being written.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, BinaryIO

import google_crc32c
import numpy as np

from qmill.checkpoints.base import dtypes, staging, writer_base
from qmill.checkpoints.formats.safetensors import header as header_lib
from qmill.checkpoints.formats.safetensors import source as source_lib

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_COPY_CHUNK = 64 * 2**20


# Header bytes reserved per source entry: three tensors P/array/{qvalue,scale,zero_point} of
# ~90 bytes of JSON plus the name each, and the qmill.dtypes and qmill.packed records.
_RESERVE_PER_ENTRY = 100
_RESERVE_SLACK = 4096


def header_reserve(entries: list[Any]) -> int:
    """Header bytes to reserve for the outputs of these source entries (a multiple of 8)."""
    reserve = _RESERVE_SLACK + sum(5 * (len(e.path) + _RESERVE_PER_ENTRY) for e in entries)
    return reserve + (-reserve % 8)


class _Shard:
    """One output file, staged: tensors appended behind `reserve` bytes kept for the header.

    The data file is opened with the first tensor (or at commit), so a run that writes nothing
    makes nothing. With `checksums`, `add` returns each tensor's crc32c (for InPlace notes)."""

    def __init__(self, data_path: pathlib.Path, reserve: int = 0, *, checksums: bool = False):
        self.data_path = data_path
        self.reserve = reserve
        self._checksums = checksums
        self._data: BinaryIO | None = None
        self.tensors: dict[str, dict[str, Any]] = {}
        self.record = dtypes.Record()
        self.nbytes = 0

    @property
    def data_start(self) -> int:
        return 8 + self.reserve if self.reserve else 0

    def _file(self) -> BinaryIO:
        if self._data is None:
            self._data = open(self.data_path, "wb")  # noqa: SIM115 - closed in finish/close
            self._data.seek(self.data_start)
        return self._data

    def add(self, key: str, array: np.ndarray) -> int | None:
        stored = self.record.store(key, array, header_lib.NATIVE)
        if stored.dtype.byteorder == ">":
            stored = stored.astype(stored.dtype.newbyteorder("<"))
        # order="C" without ascontiguousarray, which would turn a 0-d array into a 1-d one.
        stored = np.asarray(stored, order="C")
        data = stored.reshape(-1).view(np.uint8)
        if stored.nbytes:
            self._file().write(memoryview(data))
        self.tensors[key] = {
            "dtype": header_lib.CODE_OF[stored.dtype.name],
            "shape": list(stored.shape),
            "data_offsets": [self.nbytes, self.nbytes + stored.nbytes],
        }
        self.nbytes += stored.nbytes
        if not self._checksums:
            return None
        return google_crc32c.value(data) if data.size else 0

    def restore(self, key: str, event: dict[str, Any]) -> None:
        """Takes back tensor `key` as an interrupted run wrote it (an InPlace note's event)."""
        self.tensors[key] = {k: event[k] for k in ("dtype", "shape", "data_offsets")}
        if event.get("logical"):
            self.record.dtypes[key] = event["logical"]
        if event.get("packed") is not None:
            self.record.packed[key] = list(event["packed"])
        self.nbytes = event["data_offsets"][1]

    def reopen(self, checksums: dict[str, int]) -> None:
        """Reopens the data of an interrupted run: checks each restored tensor's crc32c and
        cuts whatever was written after the last of them."""
        if not self.tensors:
            return  # nothing restored: written from the start
        damaged = f"{self.data_path.parent.parent}: the output data an interrupted run wrote"
        try:
            data = open(self.data_path, "r+b")  # noqa: SIM115 - closed in finish/close
        except FileNotFoundError:
            raise ValueError(f"{damaged} is missing; {_RESTART}") from None
        self._data = data
        if os.fstat(data.fileno()).st_size < self.data_start + self.nbytes:
            raise ValueError(f"{damaged} is shorter than its log says; {_RESTART}")
        for key, info in self.tensors.items():
            begin, end = info["data_offsets"]
            if _crc32c(data, self.data_start + begin, end - begin) != checksums[key]:
                raise ValueError(f"{damaged} is corrupted at {key} (crc32c); {_RESTART}")
        data.truncate(self.data_start + self.nbytes)
        data.seek(self.data_start + self.nbytes)

    def finish(self, path: pathlib.Path, metadata: dict[str, str]) -> None:
        """Writes the finished file at `path`."""
        self._file().close()
        metadata = dict(metadata) | header_lib.record_metadata(self.record)
        header = header_lib.encode_header(self.tensors, metadata)
        if self.reserve and len(header) - 8 <= self.reserve:
            with open(self.data_path, "r+b") as f:
                f.write(header_lib.encode_header(self.tensors, metadata, size=self.reserve))
            os.replace(self.data_path, path)
            return
        with open(path, "wb") as out:
            out.write(header)
            _append(self.data_path, self.data_start, out, self.nbytes)
        self.data_path.unlink()

    def flush(self) -> None:
        if self._data is not None:
            self._data.flush()

    def close(self) -> None:
        if self._data is not None:
            self._data.close()


_RESTART = "pass --restart to discard the partial output"


def _crc32c(f: BinaryIO, offset: int, nbytes: int) -> int:
    crc, done = 0, 0
    while done < nbytes:
        chunk = os.pread(f.fileno(), min(_COPY_CHUNK, nbytes - done), offset + done)
        if not chunk:
            break
        crc = google_crc32c.extend(crc, chunk)
        done += len(chunk)
    return crc


def _append(src_path: pathlib.Path, offset: int, dst: BinaryIO, nbytes: int) -> None:
    """Appends nbytes of src_path from `offset` to dst, in the kernel where the OS allows it."""
    dst.flush()
    copied = 0
    with open(src_path, "rb", buffering=0) as src:
        try:
            while copied < nbytes:
                n = os.copy_file_range(src.fileno(), dst.fileno(), nbytes - copied, offset + copied)
                if n == 0:
                    break
                copied += n
        except (AttributeError, OSError):
            pass  # missing (macOS) or refused by the filesystem: finish in Python
        dst.seek(0, os.SEEK_END)
        src.seek(offset + copied)
        while copied < nbytes:
            chunk = src.read(min(_COPY_CHUNK, nbytes - copied))
            if not chunk:
                raise OSError(f"{src_path} is shorter than the {nbytes} bytes written to it")
            dst.write(chunk)
            copied += len(chunk)


class SafetensorsWriter(writer_base.WriterBase):
    def __init__(
        self,
        destination: str | os.PathLike,
        *,
        like: Any = None,
        overwrite: bool = False,
        max_shard_bytes: int | None = None,
        in_place: staging.InPlace | None = None,
    ) -> None:
        super().__init__()
        # In place: the shards' data go to in_place.directory (the partial output), where an
        # interrupted run left them, and every tensor written is noted for the log.
        self._in_place = in_place
        self._events: list[dict[str, Any]] = []
        # Any source tells which tensors will come (to reserve header space); a safetensors
        # one also gives its sharding and __metadata__.
        source = like
        like = like if isinstance(like, source_lib.SafetensorsSource) else None
        self._mirror = like if like is not None and like.sharded else None
        self._max_shard_bytes = None if self._mirror else max_shard_bytes
        sharded = self._mirror is not None or max_shard_bytes is not None
        self._single_file = str(destination).endswith(".safetensors")
        if self._single_file and sharded:
            raise ValueError(
                f"{destination}: a sharded safetensors output is a directory; give a path "
                "that does not end in .safetensors"
            )
        self._out = staging.StagedOutput(destination, overwrite=overwrite)
        self._sharded = sharded
        self._metadata = dict(like.metadata) if like is not None else {}
        self._shards: list[_Shard] = []
        if not self._single_file:
            self._out.staging.mkdir()
        if self._mirror is not None:
            for i in range(len(self._mirror.files)):
                self._new_shard(self._reserve(source, i))
        else:
            # Shards cut by size can't tell ahead which entries they will hold.
            self._new_shard(self._reserve(source, None) if not sharded else 0)
        if in_place is not None:
            try:
                self._resume(in_place.written)
            except BaseException:
                self._abort()
                raise

    def set_metadata(self, key: str, value: str) -> None:
        """Adds `key: value` to every file's __metadata__ (before commit)."""
        self._metadata[key] = value

    def _reserve(self, source: Any, shard: int | None) -> int:
        if source is None:
            return 0
        entries = source.entries()
        if shard is not None:
            entries = [e for e in entries if self._mirror.shard_of(e.path) == shard]
        return header_reserve(entries)

    def _new_shard(self, reserve: int = 0) -> _Shard:
        number = len(self._shards)
        if self._in_place is not None:
            self._in_place.directory.mkdir(parents=True, exist_ok=True)
            data = self._in_place.directory / f"{number:05d}.data"
        elif self._single_file:
            data = self._out.staging.with_name(self._out.staging.name + ".data")
        else:
            data = self._out.staging / f".data-{number:05d}"
        shard = _Shard(data, reserve, checksums=self._in_place is not None)
        self._shards.append(shard)
        return shard

    def _resume(self, notes: tuple[dict[str, Any], ...]) -> None:
        """Takes back the tensors an interrupted run wrote in place (their notes, in order)."""
        checksums: dict[str, int] = {}
        for note in notes:
            for event in note["events"]:
                while len(self._shards) <= event["shard"]:
                    self._new_shard()  # shards cut by size, in the order they were made
                key = event["key"]
                self._shards[event["shard"]].restore(key, event)
                self._keys.add(key)
                checksums[key] = event["crc32c"]
        for shard in self._shards:
            shard.reopen(checksums)

    def take_events(self) -> list[dict[str, Any]]:
        """Where the tensors written since the last call went (InPlace: for the log). Their
        bytes are handed to the kernel first: a log line must never name data a kill could
        still lose in this process's buffers."""
        for shard in self._shards:
            shard.flush()
        events, self._events = self._events, []
        return events

    def _shard_for(self, origin: str, nbytes: int) -> _Shard:
        if self._mirror is not None:
            # A tensor the input did not have goes into the first shard.
            return self._shards[self._mirror.shard_of(origin) or 0]
        current = self._shards[-1]
        limit = self._max_shard_bytes
        if limit is not None and current.tensors and current.nbytes + nbytes > limit:
            return self._new_shard()
        return current

    def _put(self, key: str, array: np.ndarray, origin: str) -> None:
        shard = self._shard_for(origin, dtypes.packed_nbytes(array.dtype, array.shape))
        crc = shard.add(key, array)
        if self._in_place is not None:
            self._events.append(
                {
                    "key": key,
                    "shard": self._shards.index(shard),
                    **shard.tensors[key],
                    "logical": shard.record.dtypes.get(key),
                    "packed": shard.record.packed.get(key),
                    "crc32c": crc,
                }
            )

    def _commit(self) -> None:
        if self._single_file:
            self._shards[0].finish(self._out.staging, self._metadata)
        elif not self._sharded:
            self._shards[0].finish(self._out.staging / SINGLE_NAME, self._metadata)
        else:
            count = len(self._shards)
            names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
            weight_map = {}
            for shard, name in zip(self._shards, names, strict=True):
                shard.finish(self._out.staging / name, self._metadata)
                weight_map.update(dict.fromkeys(shard.tensors, name))
            index = {
                "metadata": {"total_size": sum(s.nbytes for s in self._shards)},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (self._out.staging / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        self._out.commit()

    def _abort(self) -> None:
        for shard in self._shards:
            shard.close()
        self._out.abort()
