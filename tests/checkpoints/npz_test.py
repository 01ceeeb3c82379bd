"""npz: outputs load with plain numpy, archives numpy wrote are read member by member."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from qmill import checkpoints


def test_output_loads_with_numpy_without_pickle(tmp_path, sample):
    dest = tmp_path / "out.npz"
    kernel = sample(np.float32, (4, 3))
    qvalue = sample(ml_dtypes.uint4, (4, 3))
    with checkpoints.create_writer(dest, "npz") as writer:
        writer.write("params/Dense_0/kernel", kernel)
        writer.write_quantized(
            "params/Dense_1/kernel", {"qvalue": qvalue, "scale": np.ones((1, 3), np.float32)}
        )
    with np.load(dest, allow_pickle=False) as archive:
        assert archive["params/Dense_0/kernel"].tobytes() == kernel.tobytes()
        # 12 uint4 codes, two per byte, low nibble first.
        stored = archive["params/Dense_1/kernel/array/qvalue"]
        codes = qvalue.astype(int).reshape(-1)
        assert stored.dtype == np.uint8 and stored.shape == (6,)
        assert stored.tolist() == (codes[0::2] | codes[1::2] << 4).tolist()
        record = json.loads(str(archive["__qmill_dtypes__"]))
        assert record == {"params/Dense_1/kernel/array/qvalue": "uint4"}
        shapes = json.loads(str(archive["__qmill_packed__"]))
        assert shapes == {"params/Dense_1/kernel/array/qvalue": [4, 3]}
    with checkpoints.open_source(dest) as source:
        assert source.format == "npz" and source.separator == "/"
        assert [e.path for e in source.entries()] == [
            "params/Dense_0/kernel",
            "params/Dense_1/kernel/array/qvalue",
            "params/Dense_1/kernel/array/scale",
        ]
        back = source.read("params/Dense_1/kernel/array/qvalue")
        assert back.dtype == ml_dtypes.uint4 and back.tobytes() == qvalue.tobytes()


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_reads_archives_numpy_wrote(tmp_path, sample, save):
    tree = {"params/a": sample(np.float32, (5, 2)), "step": np.array(3, np.int32)}
    save(tmp_path / "np.npz", **tree)
    with checkpoints.open_source(tmp_path / "np.npz") as source:
        entries = {e.path: e for e in source.entries()}
        assert entries["params/a"].nbytes == 40 and entries["step"].shape == ()
        for path, array in tree.items():
            assert source.read(path).tobytes() == array.tobytes()
        with pytest.raises(KeyError, match="nope"):
            source.read("nope")


def test_object_arrays_are_refused_not_unpickled(tmp_path):
    np.savez(tmp_path / "obj.npz", o=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match="object array"):
        checkpoints.open_source(tmp_path / "obj.npz")
