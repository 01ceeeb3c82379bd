"""Writing .npz archives member by member, uncompressed like `np.savez`, into a staged file.

npy describes only numpy's own dtypes: 4-bit arrays are packed two codes per byte, bfloat16 and
float8 go into carriers (see dtypes.py); their logical dtypes go into a `__qmill_dtypes__` member
and the logical shapes of packed ones into `__qmill_packed__`, both written on commit.
"""

from __future__ import annotations

import json
import os
import zipfile

import numpy as np

from qmill.checkpoints.base import dtypes, staging, writer_base
from qmill.checkpoints.formats.npz.source import DTYPES_MEMBER, PACKED_MEMBER

# numpy's own dtypes only; ml_dtypes types need a carrier (npy cannot name them).
_NATIVE = dtypes.NUMPY_NATIVE


class NpzWriter(writer_base.WriterBase):
    def __init__(self, destination: str | os.PathLike, *, overwrite: bool = False) -> None:
        super().__init__()
        self._out = staging.StagedOutput(destination, overwrite=overwrite)
        self._zip = zipfile.ZipFile(self._out.staging, "w", allowZip64=True)
        self._record = dtypes.Record()

    def _put(self, key: str, array: np.ndarray, origin: str) -> None:
        if key in (DTYPES_MEMBER, PACKED_MEMBER):
            raise ValueError(f"{key} is reserved for qmill's dtype record")
        stored = self._record.store(key, array, _NATIVE)
        # write_array streams the member in bounded chunks; the archive never holds two.
        with self._zip.open(_member(key + ".npy"), "w", force_zip64=True) as f:
            np.lib.format.write_array(f, stored, allow_pickle=False)

    def _commit(self) -> None:
        for name, record in (
            (DTYPES_MEMBER, self._record.dtypes),
            (PACKED_MEMBER, self._record.packed),
        ):
            if record:
                text = np.array(json.dumps(record, sort_keys=True))
                with self._zip.open(_member(name + ".npy"), "w") as f:
                    np.lib.format.write_array(f, text, allow_pickle=False)
        self._zip.close()
        self._out.commit()

    def _abort(self) -> None:
        self._zip.close()
        self._out.abort()


def _member(name: str) -> zipfile.ZipInfo:
    """A member stamped with a fixed time (zip's epoch), not the clock's: the same tensors make
    the same bytes, so a resumed run's archive equals an uninterrupted one's."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.external_attr = 0o644 << 16  # rw-r--r-- when unzipped, as a plain file
    return info
