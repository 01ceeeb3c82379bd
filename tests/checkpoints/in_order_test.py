"""The checkpoint is written as tensors finish, in entry order, whatever order results come in."""

from __future__ import annotations

import numpy as np

from qmill.checkpoints.base import staging
from qmill.checkpoints.formats import registry as formats
from qmill.checkpoints.run import pipeline
from tests.checkpoints.resume_test import RECIPE, FakeBackend


def _source(tmp_path, sample):
    path = tmp_path / "src.safetensors"
    with formats.create_writer(path, "safetensors") as writer:
        for i in range(4):
            writer.write(f"layer_{i}/kernel", sample(np.float32, (16, 8), seed=i))
            writer.write(f"layer_{i}/bias", sample(np.float32, (8,), seed=10 + i))
        writer.write("step", np.array([7], np.int32))
    return path


class Reversed(FakeBackend):
    """Answers every tensor, last first (as several replicas may)."""

    def quantize(self, recipe, tensors, **kwargs):
        yield from reversed(list(super().quantize(recipe, tensors, **kwargs)))


def test_results_out_of_order_give_the_same_bytes(tmp_path, sample):
    source = _source(tmp_path, sample)
    pipeline.quantize_checkpoint(source, tmp_path / "a.safetensors", RECIPE, backend=FakeBackend())
    pipeline.quantize_checkpoint(source, tmp_path / "b.safetensors", RECIPE, backend=Reversed())
    a = (tmp_path / "a.safetensors").read_bytes()
    assert a == (tmp_path / "b.safetensors").read_bytes()


def test_results_in_order_are_written_from_memory_not_read_back(tmp_path, sample, monkeypatch):
    source = _source(tmp_path, sample)
    loads: list[str] = []
    load = staging.PartialOutput.load
    monkeypatch.setattr(
        staging.PartialOutput, "load", lambda self, path: loads.append(path) or load(self, path)
    )
    pipeline.quantize_checkpoint(source, tmp_path / "a.safetensors", RECIPE, backend=FakeBackend())
    assert loads == []
    pipeline.quantize_checkpoint(source, tmp_path / "b.safetensors", RECIPE, backend=Reversed())
    assert len(loads) == 3  # every kernel but the first, which came last and in its turn
    a = (tmp_path / "a.safetensors").read_bytes()
    assert a == (tmp_path / "b.safetensors").read_bytes()
