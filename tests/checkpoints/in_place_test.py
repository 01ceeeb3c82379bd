"""One write (issue 27): a safetensors output's results go once, into the output's data kept in
the partial output, and a resumed run takes that data back instead of a second copy."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from qmill.checkpoints.base import staging
from qmill.checkpoints.run import embedded, pipeline
from tests.checkpoints.hf_folder_test import _hf_folder, _tree
from tests.checkpoints.resume_test import RECIPE, FakeBackend, Interrupted, _make_source

# Ten float tensors (kernel 16x8 then bias of layer_0 ... layer_4) and an int32.
TENSORS = 10


@pytest.fixture
def source(tmp_path, sample):
    return _make_source(tmp_path, "safetensors", sample)


def _one_go(source, tmp_path) -> bytes:
    reference = tmp_path / "reference.safetensors"
    pipeline.quantize_checkpoint(source, reference, RECIPE, backend=FakeBackend())
    return reference.read_bytes()


def _interrupted(source, dest, after: int) -> staging.PartialOutput:
    with pytest.raises(Interrupted):
        pipeline.quantize_checkpoint(source, dest, RECIPE, backend=FakeBackend(fail_after=after))
    return dest.with_name(dest.name + staging.PARTIAL_SUFFIX)


def _lines(partial) -> list[dict]:
    return [json.loads(line) for line in (partial / staging.LOG).read_text().splitlines()]


def test_results_in_order_are_written_once_and_taken_back_on_resume(tmp_path, source):
    reference = _one_go(source, tmp_path)
    dest = tmp_path / "out.safetensors"
    partial = _interrupted(source, dest, after=4)

    lines = _lines(partial)
    first_four = ["layer_0/kernel", "layer_0/bias", "layer_1/kernel", "layer_1/bias"]
    assert [line["path"] for line in lines] == first_four
    # No result was written a second time as parts: each is in the output's data, noted in
    # its line with where its bytes are and their crc32c.
    assert not list((partial / staging.PARTS).iterdir())
    notes = [note for line in lines for note in line["written"]]
    assert [note["path"] for note in notes] == [line["path"] for line in lines]
    kernel = next(note for note in notes if note["path"] == "layer_0/kernel")
    assert kernel["call"] == "quantized"
    assert kernel["parts"] == {"qvalue": "int8", "scale": "float32"}
    events = [event for note in notes for event in note["events"]]
    data = (partial / staging.DATA / "00000.data").read_bytes()
    assert len(data) > max(event["data_offsets"][1] for event in events)

    resumed = FakeBackend()
    pipeline.quantize_checkpoint(source, dest, RECIPE, backend=resumed)
    assert len(resumed.sent) == TENSORS - 4
    assert not {line["path"] for line in lines} & set(resumed.sent)
    assert dest.read_bytes() == reference
    assert not partial.exists()


def test_data_written_after_the_last_line_is_cut_on_resume(tmp_path, source):
    reference = _one_go(source, tmp_path)
    dest = tmp_path / "out.safetensors"
    partial = _interrupted(source, dest, after=3)
    with open(partial / staging.DATA / "00000.data", "ab") as f:
        f.write(b"\xff" * 1000)  # a tensor torn by a kill before its line was logged
    pipeline.quantize_checkpoint(source, dest, RECIPE, backend=FakeBackend())
    assert dest.read_bytes() == reference


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_output_data_is_refused_with_the_fix(tmp_path, source, damage):
    reference = _one_go(source, tmp_path)
    dest = tmp_path / "out.safetensors"
    partial = _interrupted(source, dest, after=4)
    data = partial / staging.DATA / "00000.data"
    events = [e for line in _lines(partial) for n in line["written"] for e in n["events"]]
    end = len(data.read_bytes())
    if damage == "flip":
        with open(data, "r+b") as f:
            f.seek(end - 1)  # inside the last tensor written
            byte = f.read(1)
            f.seek(end - 1)
            f.write(bytes([byte[0] ^ 1]))
        expected = f"corrupted at {events[-1]['key']} \\(crc32c\\)"
    elif damage == "truncate":
        with open(data, "r+b") as f:
            f.truncate(end - 1)
        expected = "shorter than its log says"
    else:
        data.unlink()
        expected = "is missing"
    with pytest.raises(ValueError, match=f"{expected}; pass --restart"):
        pipeline.quantize_checkpoint(source, dest, RECIPE, backend=FakeBackend())
    assert not dest.exists()
    pipeline.quantize_checkpoint(source, dest, RECIPE, backend=FakeBackend(), restart=True)
    assert dest.read_bytes() == reference


def test_without_in_place_every_result_is_kept_as_parts(tmp_path, source):
    """What a job whose partial output is mirrored part by part asks for (in_place=False)."""
    reference = _one_go(source, tmp_path)
    dest = tmp_path / "out.safetensors"
    with pytest.raises(Interrupted):
        pipeline.quantize_checkpoint(
            source, dest, RECIPE, backend=FakeBackend(fail_after=4), in_place=False
        )
    partial = dest.with_name(dest.name + staging.PARTIAL_SUFFIX)
    assert all("written" not in line for line in _lines(partial))
    assert len(list((partial / staging.PARTS).iterdir())) == 2 * 2  # two kernels' two parts
    assert not (partial / staging.DATA).exists()
    # A run that does write in place resumes from those parts; one that does not refuses
    # data written in place rather than misread it.
    pipeline.quantize_checkpoint(source, dest, RECIPE, backend=FakeBackend())
    assert dest.read_bytes() == reference
    partial = _interrupted(source, tmp_path / "again.safetensors", after=4)
    with pytest.raises(ValueError, match="written in place, which this run does not do"):
        pipeline.quantize_checkpoint(
            source, tmp_path / "again.safetensors", RECIPE, backend=FakeBackend(), in_place=False
        )


class _StopsAfter:
    """The embedded engine, stopped after `count` results as a killed run would be."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.inner = embedded.EmbeddedClient()

    def quantize(self, recipe, tensors, **kwargs):
        for i, outcome in enumerate(self.inner.quantize(recipe, tensors, **kwargs)):
            if i == self.count:
                raise Interrupted
            yield outcome


@pytest.mark.parametrize("sharded", [True, False])
def test_a_resumed_folder_says_what_the_interrupted_run_wrote(tmp_path, sharded):
    """config.json lists the weights kept in float and the ones quantized: those the
    interrupted run wrote in place come from its notes, so the config is the one-go one."""
    source = _hf_folder(tmp_path, sharded=sharded)
    recipe = {"rules": [{"path_regex": ".*query.*", "qtype": "int8"}]}
    once = tmp_path / "once"
    pipeline.quantize_checkpoint(source, once, recipe, backend=embedded.EmbeddedClient())
    config = json.loads((once / "config.json").read_text())["quantization_config"]
    assert config["ignore"] == ["embeddings.word_embeddings.weight"]

    out = tmp_path / "resumed"
    with pytest.raises(Interrupted):
        pipeline.quantize_checkpoint(source, out, recipe, backend=_StopsAfter(2))
    partial = out.with_name(out.name + staging.PARTIAL_SUFFIX)
    noted = [n["path"] for line in _lines(partial) for n in line["written"]]
    assert "embeddings.word_embeddings.weight" in noted  # kept, written before the stop
    pipeline.quantize_checkpoint(source, out, recipe, backend=embedded.EmbeddedClient())
    assert _tree(out) == _tree(once)


def test_results_that_come_early_wait_as_parts_and_are_noted_when_written(tmp_path, source):
    """Several streams: a result ahead of its turn is kept as parts; once the ones before it
    arrive it is written too, and noted in the line of the result that let it through."""
    reference = _one_go(source, tmp_path)

    class Reversed(FakeBackend):
        def quantize(self, recipe, tensors, **kw):
            outcomes = list(super().quantize(recipe, tensors, **kw))
            yield from reversed(outcomes[:4])
            raise Interrupted

    dest = tmp_path / "out.safetensors"
    with pytest.raises(Interrupted):
        pipeline.quantize_checkpoint(source, dest, RECIPE, backend=Reversed())
    partial = dest.with_name(dest.name + staging.PARTIAL_SUFFIX)
    lines = _lines(partial)
    assert [bool(line.get("written")) for line in lines] == [False, False, False, True]
    assert [n["path"] for n in lines[-1]["written"]] == [
        "layer_0/kernel",
        "layer_0/bias",
        "layer_1/kernel",
        "layer_1/bias",
    ]
    pipeline.quantize_checkpoint(source, dest, RECIPE, backend=FakeBackend())
    assert dest.read_bytes() == reference


def test_a_finished_run_leaves_no_data_behind(tmp_path, source):
    dest = tmp_path / "out.safetensors"
    pipeline.quantize_checkpoint(source, dest, RECIPE, backend=FakeBackend())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors", "src.safetensors"]
    assert dest.read_bytes() == _one_go(source, tmp_path)  # the data file became the output


_KILLED_RUN = """
import os, sys
from qmill.checkpoints.run import pipeline
from tests.checkpoints.resume_test import RECIPE, FakeBackend

class Killed(FakeBackend):
    def quantize(self, recipe, tensors, **kw):
        for count, outcome in enumerate(super().quantize(recipe, tensors, **kw)):
            if count == int(sys.argv[3]):
                os._exit(9)  # as SIGKILL: no cleanup, no buffer flushed
            yield outcome

pipeline.quantize_checkpoint(sys.argv[1], sys.argv[2], RECIPE, backend=Killed())
"""


@pytest.mark.parametrize("after", [1, 4, 7])
def test_a_killed_run_leaves_every_logged_byte_on_disk(tmp_path, source, after):
    """The scales (32 bytes) stay in the file object's buffer after the codes are written: a
    line logged before they reach the kernel named data the kill then lost."""
    reference = _one_go(source, tmp_path)
    dest = tmp_path / "out.safetensors"
    root = pathlib.Path(__file__).resolve().parents[2]
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_RUN, str(source), str(dest), str(after)],
        cwd=root,
        capture_output=True,
        timeout=120,
    )
    assert killed.returncode == 9, killed.stderr
    partial = dest.with_name(dest.name + staging.PARTIAL_SUFFIX)
    assert len(_lines(partial)) == after
    resumed = FakeBackend()
    pipeline.quantize_checkpoint(source, dest, RECIPE, backend=resumed)
    assert len(resumed.sent) == TENSORS - after
    assert dest.read_bytes() == reference
