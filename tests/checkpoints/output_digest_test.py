"""Outputs stay byte for byte what they were: every refactor must keep these digests.

The example checkpoint in each source format is quantized with each preset into each output
format with the in-process engine; safetensors and npz files are hashed as written. Orbax
directories name their data files at random and stamp times in their metadata, so for them the
digest covers what a reader gets back: every tensor's path, dtype, shape and bytes.

Quantized codes and scales are exact on every x86-64 CPU (docs/numerics-spec.md), so the digests
are too.
The expected values were recorded before the "one house" refactor (tests/checkpoints/digests.json);
regenerate them only for a deliberate change of the output format, never to make this pass.
"""

import json
import pathlib

import pytest

from qmill.checkpoints.formats import examples
from qmill.checkpoints.run import embedded, pipeline
from qmill.client import recipes
from tests.checkpoints import digest

EXPECTED = json.loads((pathlib.Path(__file__).parent / "digests.json").read_text())
SOURCES = {"orbax": "src_orbax", "safetensors": "src.safetensors", "npz": "src.npz"}


def _digest(path: pathlib.Path, fmt: str) -> str:
    return digest.tensors(path) if fmt == "orbax" else digest.files(path)


def digests(root: pathlib.Path) -> dict[str, str]:
    found = {}
    for source_format, name in SOURCES.items():
        source = root / name
        examples.write_example_checkpoint(source, source_format)
        for recipe in sorted(recipes.PRESETS):
            for fmt in ("orbax", "safetensors", "npz"):
                out = root / f"{source_format}-{recipe}-{fmt}"
                pipeline.quantize_checkpoint(
                    source,
                    out,
                    recipes.load(recipe),
                    backend=embedded.EmbeddedClient(),
                    output_format=fmt,
                )
                found[f"{source_format}/{recipe}/{fmt}"] = _digest(out, fmt)
    return found


@pytest.mark.slow
def test_outputs_are_byte_identical_to_the_recorded_digests(tmp_path):
    assert digests(tmp_path) == EXPECTED


if __name__ == "__main__":  # python tests/checkpoints/output_digest_test.py > digests.json
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        json.dump(digests(pathlib.Path(tmp)), sys.stdout, indent=1, sort_keys=True)
        print()
