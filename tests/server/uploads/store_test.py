"""UploadStore: offsets, crc32c, content addressing, quota, a full disk, tenants, expiry."""

import errno
import hashlib

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from qmill.checkpoints.formats.safetensors import header as safetensors_header
from qmill.proto import wire
from qmill.server import errors
from qmill.server.uploads import store as store_lib

MiB = 1024 * 1024


class Clock:
    now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def store(tmp_path, clock):
    return store_lib.UploadStore(
        tmp_path, max_upload_bytes=10 * MiB, quota_bytes=1 * MiB, expiry_seconds=60, clock=clock
    )


def _send(store, tenant, uid, data, offset=0, size=1000):
    status = None
    for i in range(offset, len(data), size):
        piece = data[i : i + size]
        status = store.append(tenant, uid, i, piece, wire.crc32c(piece))
    return status


def _code(info):
    return info.value.code


def test_chunks_commit_and_the_finished_content_is_content_addressed(store):
    data = np.random.default_rng(0).bytes(5000)
    uid = store.start("a", total_bytes=len(data)).upload_id
    status = _send(store, "a", uid, data[:2000])
    assert store.query("a", uid).committed_bytes == 2000 and not status.complete
    status = _send(store, "a", uid, data, offset=2000)
    sha = hashlib.sha256(data).hexdigest()
    assert status.complete and status.sha256 == sha
    assert store.blob_path(sha).read_bytes() == data
    # The same bytes again: stored once; with the sha256 announced, complete at once.
    again = store.start("a", total_bytes=len(data), sha256=sha)
    assert again.complete and again.committed_bytes == len(data)
    uid3 = store.start("a", total_bytes=len(data)).upload_id
    assert _send(store, "a", uid3, data).sha256 == sha
    assert [p.name for p in (store.root / "blobs").iterdir()] == [sha]


def test_bad_crc_is_data_loss_and_keeps_nothing(store):
    uid = store.start("a", total_bytes=10).upload_id
    with pytest.raises(wire.WireError) as info:  # a chunk's bytes break the wire contract
        store.append("a", uid, 0, b"01234", wire.crc32c(b"01235"))
    assert _code(info) == "DATA_LOSS" and store.query("a", uid).committed_bytes == 0


def test_wrong_offset_is_out_of_range_naming_the_committed_offset(store):
    uid = store.start("a", total_bytes=10).upload_id
    _send(store, "a", uid, b"0123")
    with pytest.raises(errors.OutOfRange, match="resume from 4") as info:
        store.append("a", uid, 6, b"67", wire.crc32c(b"67"))
    assert _code(info) == "OUT_OF_RANGE"
    with pytest.raises(errors.OutOfRange) as info:
        store.append("a", uid, 4, b"4567890", wire.crc32c(b"4567890"))  # past the total
    assert _code(info) == "OUT_OF_RANGE"


def test_quota_and_size_limit_are_resource_exhausted(store):
    store.start("a", total_bytes=MiB - 10)
    with pytest.raises(errors.ResourceExhausted, match="quota") as info:
        store.start("a", total_bytes=20)
    assert _code(info) == "RESOURCE_EXHAUSTED"
    store.start("b", total_bytes=20)  # the quota is per tenant
    with pytest.raises(errors.ResourceExhausted, match="limit") as info:
        store.start("b", total_bytes=11 * MiB)
    assert _code(info) == "RESOURCE_EXHAUSTED"


def test_full_disk_is_resource_exhausted_and_the_upload_stays_consistent(store, monkeypatch):
    data = b"x" * 3000
    uid = store.start("a", total_bytes=len(data)).upload_id
    _send(store, "a", uid, data[:1000])
    real = store_lib.UploadStore._os_write

    def full(fd, view):
        real(fd, view[:10])  # a partial write, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_lib.UploadStore, "_os_write", staticmethod(full))
    with pytest.raises(errors.ResourceExhausted, match="disk full") as info:
        store.append("a", uid, 1000, data[1000:2000], wire.crc32c(data[1000:2000]))
    assert _code(info) == "RESOURCE_EXHAUSTED"
    assert store.query("a", uid).committed_bytes == 1000
    monkeypatch.setattr(store_lib.UploadStore, "_os_write", staticmethod(real))
    status = _send(store, "a", uid, data, offset=1000)
    assert status.complete and store.blob_path(status.sha256).read_bytes() == data


def test_another_tenants_id_is_not_found(store):
    uid = store.start("a", total_bytes=4).upload_id
    for call in (
        lambda: store.query("b", uid),
        lambda: store.append("b", uid, 0, b"abcd", wire.crc32c(b"abcd")),
        lambda: store.query("a", "../../etc/passwd"),
    ):
        with pytest.raises(errors.NotFound) as info:
            call()
        assert _code(info) == "NOT_FOUND"


def test_sha256_mismatch_drops_the_bytes(store):
    uid = store.start("a", total_bytes=4, sha256="0" * 64).upload_id
    with pytest.raises(errors.DataLoss, match="upload again from offset 0") as info:
        _send(store, "a", uid, b"abcd")
    assert _code(info) == "DATA_LOSS" and store.query("a", uid).committed_bytes == 0


def test_expired_uploads_and_their_blobs_are_swept(store, clock):
    uid = store.start("a", total_bytes=4).upload_id
    sha = _send(store, "a", uid, b"abcd").sha256
    clock.now += 61
    with pytest.raises(errors.NotFound):
        store.query("a", uid)
    assert store.sweep() == 1 and not store.blob_path(sha).exists()


def test_open_params_unflattens_safetensors_keys(store):
    tensors = {"Dense_0/kernel": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(2)}
    data = safetensors.numpy.save(tensors)
    uid = store.start("a", total_bytes=len(data)).upload_id
    with pytest.raises(errors.FailedPrecondition) as info:
        store.open_params("a", uid)
    assert _code(info) == "FAILED_PRECONDITION"
    _send(store, "a", uid, data)
    tree = store.open_params("a", uid)
    np.testing.assert_array_equal(tree["Dense_0"]["kernel"], tensors["Dense_0/kernel"])
    np.testing.assert_array_equal(tree["b"], tensors["b"])


def _upload(store, data):
    uid = store.start("a", total_bytes=len(data)).upload_id
    _send(store, "a", uid, data)
    return uid


def test_tensors_are_listed_unread_and_read_one_at_a_time(store):
    tensors = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "n": np.arange(3, dtype=np.int8)}
    uid = _upload(store, safetensors.numpy.save(tensors))
    listed = store.tensors("a", uid)
    # In the order of their bytes in the file (safetensors puts wider dtypes first).
    assert [(t.path, t.shape, t.nbytes) for t in listed] == [("w", (3, 4), 48), ("n", (3,), 3)]
    for t in listed:
        np.testing.assert_array_equal(t.read(), tensors[t.path])


def _file(header: bytes, data_bytes: int) -> bytes:
    return len(header).to_bytes(8, "little") + header + b"\0" * data_bytes


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"\x05\x00", "shorter than 8 bytes"),
        (b"\xff" * 8 + b"{}", "announce a .*-byte header"),
        (len(b"[1]").to_bytes(8, "little") + b"[1]", "not a JSON object"),
        (len(b"{x").to_bytes(8, "little") + b"{x", "not a safetensors file"),
        (
            _file(b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', 8),
            r"data_offsets \[0, 16\] for shape \[4\] .* in 8 data bytes; the file is truncated",
        ),
        (
            _file(b'{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}}', 16),
            r"data_offsets \[0, 16\] for shape \[3\] \(F32\)",
        ),
        (
            _file(b'{"w":{"dtype":"X9","shape":[1],"data_offsets":[0,8]}}', 8),
            "dtype X9, which qmill does not read",
        ),
        (
            _file(b'{"w":{"dtype":"F32","shape":[-1,-1],"data_offsets":[0,4]}}', 4),
            "negative dimension",
        ),
    ],
)
def test_malformed_safetensors_is_a_value_error_naming_the_problem(store, data, needle):
    uid = _upload(store, data)
    for read in (store.tensors, store.open_params):
        with pytest.raises(ValueError, match=needle) as info:
            read("a", uid)
        # The message names the upload, never the server's own files.
        assert f"upload {uid}" in str(info.value) and str(store.root) not in str(info.value)


@pytest.mark.parametrize(
    ("code", "dtype"),
    [
        # Refused by the upload store's own dtype table before it used qmill.checkpoints' one.
        ("U16", np.uint16),
        ("U32", np.uint32),
        ("U64", np.uint64),
        ("C64", np.complex64),
        ("F8_E8M0", ml_dtypes.float8_e8m0fnu),
    ],
)
def test_every_safetensors_dtype_of_the_shared_table_is_accepted(store, code, dtype):
    array = (2 ** np.arange(6)).reshape(2, 3).astype(dtype)  # e8m0 holds powers of two only
    uid = _upload(
        store,
        safetensors_header.encode_header(
            {"w": {"dtype": code, "shape": [2, 3], "data_offsets": [0, array.nbytes]}}, {}
        )
        + array.tobytes(),
    )
    (listed,) = store.tensors("a", uid)
    assert (listed.path, listed.dtype, listed.shape) == ("w", np.dtype(dtype), (2, 3))
    np.testing.assert_array_equal(listed.read(), array)
    # As jax arrays (64-bit types become 32-bit ones unless jax_enable_x64), the same values.
    np.testing.assert_array_equal(np.asarray(store.open_params("a", uid)["w"]), array)
