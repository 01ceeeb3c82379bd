"""Reading .npz archives (a zip of .npy members; keys are '/'-joined paths) member by member.

Entries come from the .npy headers alone; `read` decompresses one member. Arrays that npy cannot
describe were stored packed or in carriers; their logical dtypes are in the `__qmill_dtypes__`
member, the logical shapes of packed 4-bit ones in `__qmill_packed__`.
"""

from __future__ import annotations

import json
import pathlib
import zipfile

import numpy as np

from qmill.checkpoints.base import dtypes, protocols, source_base

# A 0-d unicode array holding JSON {path: logical dtype}; plain np.load reads it without pickle.
DTYPES_MEMBER = "__qmill_dtypes__"
# JSON {path: logical shape} of 4-bit arrays stored packed, two codes per byte.
PACKED_MEMBER = "__qmill_packed__"
_SUFFIX = ".npy"


class NpzSource(source_base.SourceBase):
    """Members in archive order."""

    format = "npz"
    separator = "/"

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        try:
            self._zip = zipfile.ZipFile(path)
        except zipfile.BadZipFile as e:
            raise ValueError(f"{path} is not an .npz archive ({e})") from None
        try:
            self._load_entries()
        except BaseException:
            self._zip.close()
            raise

    def _load_entries(self) -> None:
        members = [n[: -len(_SUFFIX)] for n in self._zip.namelist() if n.endswith(_SUFFIX)]
        records = {}
        for member in (DTYPES_MEMBER, PACKED_MEMBER):
            if member in members:
                try:
                    records[member] = json.loads(str(self._read_stored(member)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{self.path}: malformed {member} ({e})") from None
                members.remove(member)
        try:
            self._record = dtypes.Record(records.get(DTYPES_MEMBER), records.get(PACKED_MEMBER))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{self.path}: malformed qmill dtype record ({e})") from None
        self._entries = []
        for name in members:
            shape, stored = self._header(name)
            if stored.hasobject:
                raise ValueError(f"{self.path}: {name} is an object array; qmill won't unpickle")
            dtype, shape = self._record.logical(name, stored, shape)
            self._entries.append(protocols.entry(name, dtype, shape))
        self._paths = {e.path for e in self._entries}

    def _header(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
        with self._zip.open(name + _SUFFIX) as f:
            try:
                version = np.lib.format.read_magic(f)
                read = (
                    np.lib.format.read_array_header_1_0
                    if version == (1, 0)
                    else np.lib.format.read_array_header_2_0
                )
                shape, _, dtype = read(f)  # the header only, not the data
            except ValueError as e:
                raise ValueError(f"{self.path}: member {name} is not a .npy array ({e})") from None
        return shape, dtype

    def _read_stored(self, name: str) -> np.ndarray:
        with self._zip.open(name + _SUFFIX) as f:
            return np.lib.format.read_array(f, allow_pickle=False)

    def read(self, path: str) -> np.ndarray:
        if path not in self._paths:
            raise KeyError(f"no tensor {path!r} in {self.path}")
        try:
            return self._record.restore(path, self._read_stored(path))
        except ValueError as e:
            raise ValueError(f"{self.path}: {e}") from None

    def close(self) -> None:
        self._zip.close()
