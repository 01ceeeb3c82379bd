"""The bytes an upload sends, made one tensor at a time, and the CLI's params flags; no jax."""

from __future__ import annotations

import hashlib
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from qmill import checkpoints
from qmill.cli import main as cli
from qmill.client import upload_content

MiB = 2**20


def _old_bytes(path) -> bytes:
    """What the client sent before: every tensor read at once, then safetensors.numpy.save."""
    with checkpoints.open_source(path) as source:
        tensors = {e.path: np.asarray(source.read(e.path)) for e in source.entries()}
    return safetensors.numpy.save(tensors)


@pytest.fixture
def mixed(tmp_path):
    """An npz of many dtypes and shapes (scalars, empty tensors, non-ASCII and quoted names)."""
    rng = np.random.default_rng(0)
    tensors = {
        "params/Dense_0/kernel": rng.normal(size=(33, 7)).astype(np.float32),
        "params/Dense_0/bias": rng.normal(size=(7,)).astype(np.float32),
        "params/emb/embedding": rng.normal(size=(5, 3)).astype(ml_dtypes.bfloat16),
        "params/b/half": rng.normal(size=(4, 4)).astype(np.float16),
        "params/a/half": rng.normal(size=(3,)).astype(np.float16),
        "step": np.asarray(7, np.int64),
        "mask": rng.integers(0, 2, size=(9,)).astype(np.bool_),
        "ids": rng.integers(-100, 100, size=(11,)).astype(np.int8),
        "bytes": rng.integers(0, 255, size=(13,)).astype(np.uint8),
        "f64": rng.normal(size=(2, 2)),
        "counts": np.arange(5, dtype=np.int32),
        "fp8": rng.normal(size=(6,)).astype(ml_dtypes.float8_e4m3fn),
        "empty": np.zeros((0, 4), np.float32),
        'café/"q"\\x': np.ones((2,), np.float32),
    }
    path = tmp_path / "mixed.npz"
    with checkpoints.create_writer(path, "npz") as writer:
        for name, array in tensors.items():
            writer.write(name, array)
    return path


def test_streamed_bytes_equal_the_old_serialization(mixed):
    old = _old_bytes(mixed)
    with upload_content.open_checkpoint(mixed) as content:
        assert content.total_bytes == len(old)
        assert content.sha256() == hashlib.sha256(old).hexdigest()
        assert content.to_bytes() == old
        # Chunks from any offset (a resumed upload) are the same bytes, in fixed-size pieces.
        for offset, size in [(0, 1000), (0, 7), (301, 64), (len(old) - 3, 1000), (len(old), 8)]:
            pieces = list(content.chunks(offset, size))
            assert b"".join(p for _, p in pieces) == old[offset:]
            assert [o for o, _ in pieces] == list(range(offset, len(old), size))
            assert all(len(p) == size for _, p in pieces[:-1])


def test_a_safetensors_file_is_sent_as_it_is_in_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(upload_content, "FILE_BLOCK_BYTES", 100)
    data = safetensors.numpy.save({"w": np.arange(300, dtype=np.float32)})
    (tmp_path / "m.safetensors").write_bytes(data)
    with upload_content.open_checkpoint(tmp_path / "m.safetensors") as content:
        assert len(content.parts) == -(-len(data) // 100)
        assert content.sha256() == hashlib.sha256(data).hexdigest()
        assert b"".join(p for _, p in content.chunks(250, 64)) == data[250:]


def test_a_dtype_safetensors_cannot_hold_is_named(tmp_path):
    path = tmp_path / "int4.npz"
    with checkpoints.create_writer(path, "npz") as writer:
        writer.write("params/q", np.zeros((4,), ml_dtypes.int4))
    with (
        pytest.raises(ValueError, match=r"tensor params/q has dtype int4"),
        upload_content.open_checkpoint(path),
    ):
        pass


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_memory_stays_at_about_one_tensor(tmp_path):
    tensor_bytes, count = 2 * MiB, 8  # a 16 MiB checkpoint
    path = tmp_path / "big.npz"
    with checkpoints.create_writer(path, "npz") as writer:
        for i in range(count):
            writer.write(f"layers/{i}/w", np.full(tensor_bytes // 4, i, np.float32))

    def streamed():
        with upload_content.open_checkpoint(path) as content:
            content.sha256()
            for _ in content.chunks(0, 256 * 1024):
                pass

    new, old = _peak(streamed), _peak(lambda: _old_bytes(path))
    print(f"peak traced memory: streamed {new / MiB:.1f} MiB, whole {old / MiB:.1f} MiB")
    assert new < 3 * tensor_bytes  # the tensor, the reader's transient copy of it, a chunk
    assert old > count * tensor_bytes  # the old way held the checkpoint (twice, in fact)


@pytest.mark.parametrize("command", ["calibrate", "export-odml"])
def test_params_take_exactly_one_of_a_checkpoint_or_an_upload_id(command, tmp_path, capsys):
    base = {
        "calibrate": ["--model", "cnn", "--batches", str(tmp_path / "b.npy")],
        "export-odml": ["--model", "cnn", "-o", str(tmp_path / "m.tflite")],
    }[command]
    argv = [command, "--server", "127.0.0.1:1", *base]
    with pytest.raises(SystemExit):
        cli.main([*argv, "--params", "x.npz", "--params-upload-id", "ab"])
    assert "not allowed with argument" in capsys.readouterr().err
    # Neither: a registry model needs one (with --model-fn an NNX model brings its own params).
    assert cli.main(argv) == 1
    assert "--model needs the model's params: --params or --params-upload-id" in (
        capsys.readouterr().err
    )
    if command == "calibrate":
        np.save(tmp_path / "b.npy", np.zeros((2, 8, 8, 1), np.float32))
    uid = "0123456789abcdef0123456789abcdef"
    assert cli.main([*argv, "--params", uid]) == 1
    err = capsys.readouterr().err
    assert f"--params {uid}: no such checkpoint; to name an earlier upload, pass" in err
