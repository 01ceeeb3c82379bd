"""A user's first day, part II (issue 38): what qmill used to do silently or noisily, run as a
user runs it — the `qmill` CLI in a child process."""

from __future__ import annotations

import re
import subprocess
import sys

from qmill.server import auth
from tests.e2e import processes

TIMEOUT = 300

# `qmill` whose checkpoint reads after the first wait until the interpreter is exiting (its
# executors shut down): what happened, 1 run in 3, when a call was refused while grpc's request
# thread was reading the next tensor as the process exited.
_READS_AT_EXIT = """
import sys, time
from concurrent.futures import thread
from qmill.checkpoints.formats import registry as formats
from qmill.cli import main as cli

open_source = formats.open_source

def open_late(path):
    source = open_source(path)
    read, reads = source.read, []

    def late_read(tensor):
        reads.append(tensor)
        deadline = time.monotonic() + 20
        while len(reads) > 1 and not thread._shutdown and time.monotonic() < deadline:
            time.sleep(0.001)
        return read(tensor)

    source.read = late_read
    return source

formats.open_source = open_late
sys.exit(cli.main(sys.argv[1:]))
"""


def _qmill(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*processes.qmill(), *args], capture_output=True, text=True, timeout=TIMEOUT
    )


def test_a_refused_call_prints_one_line_and_no_traceback(make_server, tmp_path):
    running = make_server(tokens=auth.TokenTable.from_mapping({"t": {"tenant": "a"}}))
    for i in range(20):
        run = subprocess.run(
            [sys.executable, "-c", _READS_AT_EXIT, "quantize", str(processes.SOURCE), "-o",
             str(tmp_path / f"out{i}.npz"), "-q", "--server", running.address],
            capture_output=True, text=True, timeout=TIMEOUT,
        )  # fmt: skip
        assert run.returncode == 1, run.stderr
        assert run.stderr.startswith("qmill: error: UNAUTHENTICATED: missing bearer token")
        assert run.stderr.count("\n") == 1, run.stderr


def _gptq_stats(path, weights: dict[str, int]) -> None:
    """A GPTQ statistics file as `qmill calibrate --stats-output` writes it: for each weight, the
    input Hessian's sum over `count` rows (here a random positive-definite one)."""
    import numpy as np

    rng = np.random.default_rng(0)
    stats = {}
    for weight, features in weights.items():
        x = rng.normal(size=(4 * features, features)).astype(np.float32)
        stats[f"{weight}_gptq/count"] = np.array(4 * features, np.int32)
        stats[f"{weight}_gptq/sum_of_hessian"] = x.T @ x
    np.savez(path, **stats)


def test_statistics_that_name_no_tensor_are_refused_before_any_work(tmp_path):
    # A model's statistics under other paths than the checkpoint's: a plain round-to-nearest
    # output, rc 0, used to come out as if calibrated.
    _gptq_stats(tmp_path / "stats.npz", {"model/decoder/dense/kernel": 64})
    out = tmp_path / "out.npz"
    run = _qmill(
        "quantize", str(processes.SOURCE), "-o", str(out), "--calibration",
        str(tmp_path / "stats.npz"),
    )  # fmt: skip
    assert run.returncode == 1, run.stderr
    assert run.stderr.count("\n") == 1, run.stderr
    assert "name none of the 4 tensors the recipe quantizes" in run.stderr
    assert "model/decoder/dense/kernel" in run.stderr  # a statistic's name ...
    assert "params/Dense_1/kernel" in run.stderr  # ... and a tensor's
    assert not out.exists()


def test_the_report_says_which_method_quantized_each_tensor(tmp_path):
    # Dense_1's kernel (128, 64) is (in, out): GPTQ's Hessian is over its 128 inputs.
    _gptq_stats(tmp_path / "stats.npz", {"params/Dense_1/kernel": 128})
    run = _qmill(
        "quantize", str(processes.SOURCE), "-o", str(tmp_path / "out.npz"), "--calibration",
        str(tmp_path / "stats.npz"), "--report-json", str(tmp_path / "report.json"),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    # The three tensors without statistics are named: they are rounded to nearest.
    assert "3 of 4 quantized tensors have no statistics" in run.stderr
    assert "params/Conv_0/kernel" in run.stderr
    assert ", GPTQ" in run.stdout and ", RTN" in run.stdout  # the groups name the method
    # The weight SQNR is explained, not left to read as GPTQ's regression.
    assert "GPTQ: the SQNR above is the weight's" in " ".join(run.stdout.split())
    import json

    report = json.loads((tmp_path / "report.json").read_text())
    rows = {r["path"]: r["method"] for r in report["tensors"]}
    assert rows["params/Dense_1/kernel"] == "GPTQ"
    assert rows["params/Conv_0/kernel"] == "RTN"
    assert rows["step"] == ""
    # What GPTQ minimises, measured beside round to nearest's on the same inputs.
    assert "output (RTN)" in run.stdout
    gptq = next(r for r in report["tensors"] if r["path"] == "params/Dense_1/kernel")
    assert gptq["output_sqnr_db"] > 0 and gptq["rtn_output_sqnr_db"] > 0


def _model_folder_without_config(tmp_path):
    """tiny-bert as a user might have it: weights, tokenizer, README, 1_Pooling/, but the
    config.json lost."""
    import shutil

    from examples import make_inputs

    make_inputs.tiny_bert(tmp_path / "tiny-bert")
    folder = tmp_path / "no-config"
    shutil.copytree(tmp_path / "tiny-bert", folder)
    (folder / "config.json").unlink()
    return folder


def test_a_folder_without_config_json_keeps_its_other_files(tmp_path):
    folder = _model_folder_without_config(tmp_path)
    out = tmp_path / "out"
    run = _qmill("quantize", str(folder), "-o", str(out), "--recipe", "int4", "-q")
    assert run.returncode == 0, run.stderr
    others = ["README.md", "tokenizer_config.json", "vocab.txt", "1_Pooling/config.json"]
    for name in others:
        assert (out / name).read_bytes() == (folder / name).read_bytes(), name
    assert not (out / "config.json").exists()  # none made up
    # The shards keep their names, as a folder with a config.json's do.
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(
        p.name for p in folder.glob("*.safetensors")
    )


def test_compressed_tensors_output_of_a_folder_without_config_json_is_refused(tmp_path):
    folder = _model_folder_without_config(tmp_path)
    out = tmp_path / "out"
    run = _qmill("quantize", str(folder), "-o", str(out), "--recipe", "W4A16")
    assert run.returncode == 1
    assert "has no config.json" in run.stderr and run.stderr.count("\n") == 1
    assert not out.exists()


def test_a_resumed_run_says_so(tmp_path):
    out = tmp_path / "out.npz"
    first = subprocess.Popen(
        [*processes.qmill(1.0), "quantize", str(processes.SOURCE), "-o", str(out), "-q"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    processes.wait_for_finished_tensors(out, 1, first)
    processes.kill(first)
    run = _qmill("quantize", str(processes.SOURCE), "-o", str(out), "-q")
    assert run.returncode == 0, run.stderr
    assert re.search(r"^qmill: resumed: [1-5] of 6 tensors already written", run.stderr, re.M)
    fresh = _qmill("quantize", str(processes.SOURCE), "-o", str(tmp_path / "fresh.npz"), "-q")
    assert "resumed" not in fresh.stderr


def test_a_second_server_on_the_same_port_exits_naming_it():
    # gRPC's SO_REUSEPORT let it start and log "serving on 127.0.0.1:PORT"; clients then
    # alternated between the two servers.
    port = processes.free_port()
    (first,) = processes.serve(port)
    try:
        second = _qmill("serve", "--port", str(port))
    finally:
        processes.kill(first)
    assert second.returncode == 1
    assert second.stderr.startswith(f"qmill serve: port {port} on 127.0.0.1 is already in use")
    assert second.stderr.count("\n") == 1, second.stderr  # nothing else: no gRPC bind errors
