"""`qmill quantize` writes byte for byte what it wrote before: every output format, every
compressed-tensors scheme, a resumed run, the report and the plan (--dry-run).

The `qmill` command runs in this process (qmill.cli.main) over a small generated Hugging Face
Llama folder (bf16, two shards, k/v in another shard than q, k/v of 64 rows: FP8_BLOCK pads them,
NVFP4 shares a global scale across q/k/v and gate/up and stores the partners in q's shard). Each
output is hashed file by file (an Orbax one by what a reader gets back: its data files are named
at random and its metadata stamps times); the report JSON without its timings and the --dry-run
table are hashed too.

The expected digests (cli_digests.json) are these runs' with the code of main at df2feeb, before
issue 35's refactor (this file's __main__ at f6ea68d, whose imports name main's modules; now:
`python -m tests.checkpoints.cli_digest_test > tests/checkpoints/cli_digests.json`). Regenerate
them only for a deliberate change of an output, never to make this pass. Quantized codes and
scales are exact on every x86-64 CPU (docs/numerics-spec.md), so the digests are too.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pathlib
import sys

import pytest

from qmill.checkpoints.run import embedded
from qmill.cli import main
from tests.checkpoints import digest
from tests.checkpoints.llama import write_llama

EXPECTED_FILE = pathlib.Path(__file__).with_name("cli_digests.json")
# compressed-tensors' schemes when the digests were recorded (ct_schemes.SCHEMES may grow).
SCHEMES = ("W4A16", "W4A16_ASYM", "W8A16", "W8A8", "FP8_DYNAMIC")  # groups, channels
SCHEMES += ("FP8_BLOCK", "NVFP4A16", "MXFP4A16")  # blocks, fp4
# name: (source, the flags after `quantize SOURCE -o NAME`); SHARD: one safetensors file.
SHARD = "llama/model-00002-of-00002.safetensors"
RUNS: dict[str, tuple[str, list[str]]] = {
    **{f"ct-{s}": ("llama", ["--recipe", s]) for s in SCHEMES},
    "ct-NVFP4A16.safetensors": (SHARD, ["--recipe", "NVFP4A16"]),
    "ct-W4A16-g64": ("llama", ["--recipe", "W4A16", "--group-size", "64"]),
    "ct-recipe-file": ("llama", ["--recipe", "scheme.toml", "--format", "compressed-tensors"]),
    "int4-folder": ("llama", ["--recipe", "int4"]),
    "int8.npz": ("llama", ["--recipe", "int8"]),
    "fp8.safetensors": (SHARD, ["--recipe", "fp8"]),
    "nf4-orbax": ("llama", ["--recipe", "nf4", "--format", "orbax"]),
}
# Interrupted after a few tensors, then run again: the output is the uninterrupted run's.
RESUMED = {"ct-W4A16": 3, "ct-NVFP4A16": 2, "int8.npz": 4}
DRY_RUNS = ("W4A16", "FP8_BLOCK", "NVFP4A16", "int4")
# A recipe "of" a scheme: its own ignore (the o_proj kept too), W4A16's numerics.
RECIPE_FILE = """\
[[rules]]
path_regex = "(?i).*(embed|lm_head|norm|o_proj).*"
skip = true

[[rules]]
path_regex = ".*\\\\.weight"
qtype = "int4"
tile_size = 128
arithmetic = "torch"
"""


def _report_digest(report: pathlib.Path, output: pathlib.Path) -> str:
    fields = json.loads(report.read_text())
    del fields["timings"]  # seconds
    if (output / "_METADATA").exists():  # Orbax's files vary in size from one write to the next
        del fields["totals"]["disk_bytes_after"]
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _qmill(*argv: str) -> tuple[int, str, str]:
    """`qmill ARGV` in this process: (exit status, what it printed on stdout, on stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main.main(list(argv))
    return status, out.getvalue(), err.getvalue()


class _Interrupt:
    """Makes the in-process engine stop (as Ctrl-C would) after `after` results."""

    def __init__(self, after: int) -> None:
        self._after = after
        self._quantize = embedded.EmbeddedClient.quantize

    def __enter__(self) -> None:
        original, after = self._quantize, self._after

        def quantize(client, recipe, tensors, **kwargs):
            for count, result in enumerate(original(client, recipe, tensors, **kwargs)):
                if count == after:
                    raise KeyboardInterrupt
                yield result

        embedded.EmbeddedClient.quantize = quantize

    def __exit__(self, *exc: object) -> None:
        embedded.EmbeddedClient.quantize = self._quantize


def _run(name: str, source: str, flags: list[str], found: dict[str, str]) -> None:
    """Runs `name` (and, if it is one of RESUMED, its interrupted and resumed twin)."""
    for resumed in (False, True) if name in RESUMED else (False,):
        out = pathlib.Path(f"resumed-{name}" if resumed else name)
        argv = ["quantize", source, "-o", str(out), "-q", "--report-json", f"{out}.json", *flags]
        if resumed:
            with _Interrupt(RESUMED[name]):
                assert _qmill(*argv)[0] == 130
            assert not out.exists()
        status, _, err = _qmill(*argv)
        assert status == 0, (name, resumed, err)
        assert ("qmill: resumed:" in err) == resumed, err
        found[f"{out}/output"] = digest.output(out)
        if not resumed:
            found[f"{name}/report"] = _report_digest(pathlib.Path(f"{out}.json"), out)


def digests(root: pathlib.Path) -> dict[str, str]:
    """Every run's digests, the runs made in `root` (the working directory meanwhile)."""
    cwd = os.getcwd()
    os.chdir(root)
    try:
        write_llama(pathlib.Path("llama"))
        pathlib.Path("scheme.toml").write_text(RECIPE_FILE)
        found: dict[str, str] = {}
        for name, (source, flags) in RUNS.items():
            _run(name, source, flags, found)
        for recipe in DRY_RUNS:
            argv = ("quantize", "llama", "-o", "plan", "--recipe", recipe, "--dry-run")
            status, text, _ = _qmill(*argv)
            assert status == 0, recipe
            found[f"dry-run-{recipe}"] = hashlib.sha256(text.encode()).hexdigest()
        return found
    finally:
        os.chdir(cwd)


@pytest.fixture
def columns(monkeypatch):
    # The --dry-run table is as wide as the terminal: fixed here, as in the recorded digests.
    monkeypatch.setenv("COLUMNS", "160")


def test_cli_outputs_are_byte_identical_to_the_recorded_ones(tmp_path, columns):
    expected = json.loads(EXPECTED_FILE.read_text())
    found = digests(tmp_path)
    assert found.keys() == expected.keys()
    changed = sorted(k for k in expected if found[k] != expected[k])
    assert not changed, f"outputs that changed: {changed}"
    # A resumed run wrote what the uninterrupted one did.
    for name in RESUMED:
        assert found[f"resumed-{name}/output"] == found[f"{name}/output"]


if __name__ == "__main__":  # python -m tests.checkpoints.cli_digest_test > cli_digests.json
    import tempfile

    os.environ["COLUMNS"] = "160"
    with tempfile.TemporaryDirectory() as tmp:
        json.dump(digests(pathlib.Path(tmp)), sys.stdout, indent=1, sort_keys=True)
        print()
