"""The checkpoint pipeline's pure helpers (its runs are tested in resume_test.py)."""

from qmill.checkpoints.run import pipeline


def test_default_convention_follows_the_format():
    assert pipeline.with_default_convention({"rules": []}, "safetensors")["convention"] == "torch"
    assert pipeline.with_default_convention({"rules": []}, "orbax")["convention"] == "flax"
    assert (
        pipeline.with_default_convention({"convention": "flax"}, "safetensors")["convention"]
        == "flax"
    )


def test_a_checkpoint_with_empty_float_tensors_quantizes_and_keeps_them(tmp_path):
    import numpy as np

    from qmill import checkpoints
    from qmill.checkpoints.run import embedded

    tree = {
        "params/empty/kernel": np.zeros((0, 4), np.float32),
        "params/none/kernel": np.zeros((0, 0), np.float32),
        "params/dense/kernel": np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8),
    }
    with checkpoints.create_writer(tmp_path / "in.npz", "npz") as writer:
        for path, array in tree.items():
            writer.write(path, array)
    recipe = {"rules": [{"qtype": "int8", "calibration_method": "rms,3"}]}
    rows = pipeline.quantize_checkpoint(
        tmp_path / "in.npz", tmp_path / "out.npz", recipe, backend=embedded.EmbeddedClient()
    )
    kept = {r.path: r.reason for r in rows if r.qtype == "kept"}
    assert set(kept) == {"params/empty/kernel", "params/none/kernel"}
    assert all("empty tensor" in reason for reason in kept.values())
    with checkpoints.open_source(tmp_path / "out.npz") as out:
        assert out.read("params/empty/kernel").shape == (0, 4)
        assert "params/dense/kernel/array/qvalue" in {e.path for e in out.entries()}
