"""A language model calibrated by a job (SubmitJobRequest.language_model) on a real server: the
same bytes as `qmill quantize FOLDER --method gptq` in process, progress "layer i/N" in the
job's events, the perplexity and losses in the job, a job stopped with its server resuming at
the next layer to the same bytes, and bad requests refused at submit (INVALID_ARGUMENT)."""

from __future__ import annotations

import json
import pathlib
import re
import time

import numpy as np
import pytest

from qmill.checkpoints.lm import calibration as lm_calibration
from qmill.cli import lm_jobs
from qmill.cli import main as cli
from qmill.client import Client, errors, recipes
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb
from tests import lm_folder
from tests.conftest import RunningServer

VOCAB, LAYERS = lm_folder.VOCAB, lm_folder.LAYERS
GROUP = 32


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> pathlib.Path:
    pytest.importorskip("transformers")  # the interop extra writes the folder
    return lm_folder.write_llama(tmp_path_factory.mktemp("lm") / "llama")


@pytest.fixture(scope="module")
def ids(tmp_path_factory) -> dict[str, pathlib.Path]:
    shapes = {"calibration": (16, 32), "eval": (8, 32)}
    return lm_folder.write_ids(tmp_path_factory.mktemp("ids"), shapes)


@pytest.fixture(scope="module")
def in_process(llama, ids, tmp_path_factory) -> tuple[pathlib.Path, dict]:
    """The reference: `qmill quantize --method gptq` in this process."""
    root = tmp_path_factory.mktemp("in-process")
    output, report = root / "llama-gptq", root / "report.json"
    args = [
        "quantize", str(llama), "-o", str(output), "--recipe", "W4A16", "--group-size",
        str(GROUP), "--method", "gptq", "--calibration-ids", str(ids["calibration"]),
        "--eval-ids", str(ids["eval"]), "--report-json", str(report), "-q",
    ]  # fmt: skip
    assert cli.main(args) == 0
    return output, json.loads(report.read_text())


def _recipe() -> dict:
    return recipes.with_group_size(recipes.load("W4A16"), GROUP)


def _message(ids, **overrides) -> pb.LanguageModelCalibration:
    request = lm_calibration.LmRequest(
        calibration_ids=np.load(ids["calibration"]), eval_ids=np.load(ids["eval"])
    )
    message = lm_jobs.message(request)
    for field, value in overrides.items():
        if isinstance(value, pb.InlineTensor):
            getattr(message, field).CopyFrom(value)
        else:
            setattr(message, field, value)
    return message


def _submit(client: Client, llama, dest: pathlib.Path, message) -> pb.Job:
    return client.jobs.submit(
        str(llama),
        str(dest),
        _recipe(),
        output_format="compressed-tensors",
        language_model=message,
    )


def _same_bytes(a: pathlib.Path, b: pathlib.Path) -> None:
    for name in ("model.safetensors", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def _slow_layers(monkeypatch, seconds: float, first: int = 0) -> None:
    """Each decoder layer from `first` on takes `seconds` longer: WatchJob coalesces changes
    closer than its poll, and a test that stops a server needs time to do it between layers."""
    from qmill.engine.lm import sequential

    calibrate_layer, perplexity = sequential.calibrate_layer, sequential.perplexity

    def slow(cfg, layer, *args, **kwargs):
        if layer >= first:
            time.sleep(seconds)
        return calibrate_layer(cfg, layer, *args, **kwargs)

    def slow_perplexity(*args, **kwargs):  # what follows the last layer
        time.sleep(seconds)
        return perplexity(*args, **kwargs)

    monkeypatch.setattr(sequential, "calibrate_layer", slow)
    monkeypatch.setattr(sequential, "perplexity", slow_perplexity)


def test_a_job_gives_the_in_process_bytes_with_layer_progress(
    make_server, llama, ids, in_process, tmp_path, monkeypatch
):
    reference, report = in_process
    _slow_layers(monkeypatch, 0.3)  # each layer's message outlives WatchJob's 0.1 s poll
    server = make_server()
    dest = tmp_path / "llama-gptq"
    with Client(server.address, timeout=60) as client:
        job = _submit(client, llama, dest, _message(ids))
        events = list(client.jobs.watch(job.job_id))
    last = events[-1].job
    assert last.state == pb.JOB_STATE_SUCCEEDED, last.error
    _same_bytes(dest, reference)
    messages = [e.message for e in events]
    for layer in range(1, LAYERS + 1):
        assert any(m.startswith(f"layer {layer}/{LAYERS}: GPTQ loss") and "ETA" in m
                   for m in messages), messages  # fmt: skip
    job_report = json.loads(last.calibration_report_json)
    assert job_report["perplexity"] == report["perplexity"]
    assert job_report["calibration"]["gptq"] == report["calibration"]["gptq"]
    losses = [entry["losses"] for entry in job_report["calibration"]["layers"]]
    assert losses == [entry["losses"] for entry in report["calibration"]["layers"]]
    ppl = report["perplexity"]
    assert f"{ppl['source']:.4g} (source) → {ppl['quantized']:.4g} (quantized)" in last.message
    assert "GPTQ loss by layer: " in last.message and last.message.startswith(f"wrote {dest}")
    assert not lm_calibration.work_directory(dest).exists()  # removed once written


def test_a_job_stopped_with_its_server_resumes_at_the_next_layer(
    llama, ids, in_process, tmp_path, monkeypatch
):
    from qmill.engine.lm import sequential

    calibrate_layer, perplexity = sequential.calibrate_layer, sequential.perplexity
    _slow_layers(monkeypatch, 1.5, first=1)  # time to stop the server after layer 1
    data = tmp_path / "data"
    dest = tmp_path / "llama-gptq"
    first = RunningServer(data_dir=str(data))
    try:
        with Client(first.address, timeout=60) as client:
            job = _submit(client, llama, dest, _message(ids))
            for event in client.jobs.watch(job.job_id):
                if event.message.startswith("layer 1/"):
                    break
    finally:
        first.stop(grace=0.5)  # the job stops before its next layer and is kept to resume
    kept = lm_calibration.work_directory(dest)
    assert (kept / "layer-00000.npz").is_file() and not dest.exists()
    monkeypatch.setattr(sequential, "calibrate_layer", calibrate_layer)
    monkeypatch.setattr(sequential, "perplexity", perplexity)
    _slow_layers(monkeypatch, 0.3)  # each layer's message outlives WatchJob's 0.1 s poll
    second = RunningServer(data_dir=str(data))
    try:
        with Client(second.address, timeout=60) as client:
            events = list(client.jobs.watch(job.job_id))
    finally:
        second.stop()
    assert events[-1].job.state == pb.JOB_STATE_SUCCEEDED, events[-1].job.error
    messages = [e.message for e in events]
    assert not any(m.startswith("layer 1/") for m in messages), messages  # not redone
    resumed = re.compile(rf"layer {LAYERS}/{LAYERS}: .* \(resumed after [12] kept layers\)$")
    assert any(resumed.match(m) for m in messages), messages
    _same_bytes(dest, in_process[0])


def test_a_job_cancelled_while_it_calibrates_leaves_nothing(
    make_server, llama, ids, tmp_path, monkeypatch
):
    _slow_layers(monkeypatch, 0.5, first=1)
    server = make_server()
    dest = tmp_path / "cancelled"
    with Client(server.address, timeout=60) as client:
        job = _submit(client, llama, dest, _message(ids))
        for event in client.jobs.watch(job.job_id):
            if event.message.startswith("layer 1/"):
                break
        client.jobs.cancel(job.job_id)
        last = list(client.jobs.watch(job.job_id))[-1].job
    assert last.state == pb.JOB_STATE_CANCELLED
    assert not dest.exists() and not lm_calibration.work_directory(dest).exists()


def _inline(array: np.ndarray) -> pb.InlineTensor:
    """Ids as the wire carries them, in their own dtype (lm_jobs.message sends int32)."""
    data = wire.to_bytes(array)
    return pb.InlineTensor(header=wire.header_for("ids", array, data), data=data.tobytes())


def test_bad_requests_are_invalid_argument_at_submit(make_server, llama, ids, tmp_path):
    server = make_server()
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    (gpt2 / "model.safetensors").write_bytes((llama / "model.safetensors").read_bytes())
    short = _inline(np.zeros((4, 1), np.int32))
    crc = _inline(np.zeros((4, 8), np.int32))
    crc.header.crc32c ^= 1
    cases = [
        (llama, _message(ids, calibration_ids=_inline(np.full((2, 8), VOCAB + 5, np.int32))),
         "INVALID_ARGUMENT", "outside the model's vocabulary of 256"),
        (llama, _message(ids, eval_ids=_inline(np.full((2, 8), -1, np.int32))),
         "INVALID_ARGUMENT", "evaluation token ids range over [-1, -1]"),
        (gpt2, _message(ids), "INVALID_ARGUMENT", "llama"),
        (llama, _message(ids, calibration_ids=short), "INVALID_ARGUMENT",
         "at least one sample of 2 tokens"),
        (llama, _message(ids, calibration_ids=_inline(np.zeros(8, np.int32))),
         "INVALID_ARGUMENT", "(samples, tokens)"),
        (llama, _message(ids, calibration_ids=_inline(np.zeros((2, 8), np.int64))),
         "INVALID_ARGUMENT", "must be DTYPE_INT32"),
        (llama, _message(ids, calibration_ids=crc), "DATA_LOSS", "crc32c"),
        (llama, _message(ids, method="squeezellm"), "INVALID_ARGUMENT", "not one of: gptq, awq"),
        (llama, _message(ids, gptq_actorder="dynamic"), "INVALID_ARGUMENT", "static or none"),
        (tmp_path / "missing", _message(ids), "INVALID_ARGUMENT", "does not exist"),
    ]  # fmt: skip
    no_eval = _message(ids, max_ppl_increase=1.0)
    no_eval.ClearField("eval_ids")
    cases.append((llama, no_eval, "INVALID_ARGUMENT", "max_ppl_increase needs eval_ids"))
    with Client(server.address, timeout=60) as client:
        for i, (source, message, code, words) in enumerate(cases):
            dest = tmp_path / f"out-{i}"
            with pytest.raises(errors.QmillError) as raised:
                _submit(client, source, dest, message)
            assert raised.value.code == code, (words, raised.value)
            assert words in raised.value.details, (words, raised.value.details)
            assert not dest.exists() and not lm_calibration.work_directory(dest).exists()
        assert client.jobs.list() == []  # no job was made


def test_a_perplexity_gate_fails_the_job_and_writes_nothing(make_server, llama, ids, tmp_path):
    server = make_server()
    dest = tmp_path / "gated"
    with Client(server.address, timeout=60) as client:
        job = _submit(client, llama, dest, _message(ids, max_ppl_increase=-100.0))
        last = list(client.jobs.watch(job.job_id))[-1].job
    assert last.state == pb.JOB_STATE_FAILED
    assert "more than max_ppl_increase -100 %" in last.error, last.error
    assert json.loads(last.calibration_report_json)["perplexity"]["source"] > 0
    assert not dest.exists()


# --- `qmill quantize FOLDER --server ... --method gptq`: CalibrateLanguageModel -------------------


def _cli_args(llama, ids, output, *extra) -> list[str]:
    return [
        "quantize", str(llama), "-o", str(output), "--recipe", "W4A16", "--group-size",
        str(GROUP), "--method", "gptq", "--calibration-ids", str(ids["calibration"]),
        "--eval-ids", str(ids["eval"]), "-q", *map(str, extra),
    ]  # fmt: skip


def _lm_request(client: Client, llama, message) -> pb.CalibrateLanguageModelRequest:
    upload = client.upload(str(llama / "model.safetensors")).upload_id
    return pb.CalibrateLanguageModelRequest(
        config_json=(llama / "config.json").read_text(),
        weight_uploads={"model.safetensors": upload},
        recipe=recipes.message(_recipe()),
        calibration=message,
    )


def test_quantize_through_a_server_gives_the_in_process_bytes(
    make_server, llama, ids, in_process, tmp_path
):
    reference, report = in_process
    server = make_server()
    output, report_file = tmp_path / "llama-gptq", tmp_path / "report.json"
    args = _cli_args(llama, ids, output, "--server", server.address, "--report-json", report_file)
    assert cli.main(args) == 0
    _same_bytes(output, reference)
    remote = json.loads(report_file.read_text())
    assert remote["perplexity"] == report["perplexity"]
    assert remote["calibration"]["layers"] == [
        {**entry, "seconds": remote_entry["seconds"]}
        for entry, remote_entry in zip(
            report["calibration"]["layers"], remote["calibration"]["layers"], strict=True
        )
    ]
    methods = {row["path"]: row["method"] for row in remote["tensors"]}
    assert methods == {row["path"]: row["method"] for row in report["tensors"]}
    assert sorted(methods.values()).count("GPTQ") == 7 * LAYERS
    # The same request again (the weights uploaded again) finds every layer kept.
    with Client(server.address, timeout=60) as client:
        layers: list[int] = []
        again = client.calibrate_language_model(
            _lm_request(client, llama, _message(ids)), on_progress=lambda p: layers.append(p)
        )
    assert again.resumed_at_layer == LAYERS and layers == []
    assert json.loads(again.report_json)["perplexity"] == report["perplexity"]


def test_a_calibration_cut_off_resumes_on_the_server_at_the_next_layer(
    make_server, llama, ids, in_process, tmp_path, monkeypatch
):
    server = make_server()
    _slow_layers(monkeypatch, 0.5, first=1)  # the server stops before layer 2
    seen = []

    def leave_after_the_first(progress: pb.LanguageModelProgress) -> None:
        seen.append(progress.layer)
        raise KeyboardInterrupt  # the client goes away: the call is cancelled

    with Client(server.address, timeout=60) as client:
        request = _lm_request(client, llama, _message(ids))
        with pytest.raises(KeyboardInterrupt):
            client.calibrate_language_model(request, on_progress=leave_after_the_first)
        assert seen == [0]
        layers: list[int] = []
        deadline = time.monotonic() + 60
        while True:  # the first call's calibration stops at its next layer
            try:
                summary = client.calibrate_language_model(
                    request, on_progress=lambda p: layers.append(p.layer)
                )
                break
            except errors.QmillError as e:
                assert e.code == "FAILED_PRECONDITION" and "running in another call" in e.details
                assert time.monotonic() < deadline, "the first call's calibration never stopped"
                time.sleep(0.2)
    assert 1 <= summary.resumed_at_layer < LAYERS and layers[0] == summary.resumed_at_layer
    assert layers[-1] == LAYERS - 1
    assert len(summary.calibrated_tensors) == 7 * LAYERS
    # The whole command then finds every layer kept, and writes the in-process bytes.
    output = tmp_path / "llama-gptq"
    assert cli.main(_cli_args(llama, ids, output, "--server", server.address)) == 0
    _same_bytes(output, in_process[0])


def test_an_unused_calibration_expires_and_the_same_request_makes_it_again(
    make_server, llama, ids, tmp_path
):
    data = tmp_path / "data"
    with Client(make_server(data_dir=str(data)).address, timeout=60) as client:
        request = _lm_request(client, llama, _message(ids))
        calibration_id = client.calibrate_language_model(request).calibration_id
    kept = data / "calibrations" / "language-models" / calibration_id
    # Finished, it holds its results alone: neither the folder laid out for the run nor the
    # hidden states kept to resume it.
    assert sorted(p.name for p in kept.iterdir()) == ["out.qmill-calibration", "tenant"]
    work = lm_calibration.work_directory(kept / "out")
    assert (work / "layer-00000.npz").is_file() and not (work / "state.npz").exists()
    # A server started on the same data with a short expiry sweeps it, unused since.
    server = make_server(data_dir=str(data), calibration_expiry_seconds=1e-3)
    assert not kept.exists()
    weight = [("model.layers.0.mlp.up_proj.weight", np.ones((32, 32), np.float32))]
    with Client(server.address, timeout=60) as client:
        with pytest.raises(errors.QmillError) as raised:
            ranges = pb.StaticRanges(calibration_id=calibration_id)
            list(client.quantize(_recipe(), weight, static_ranges=ranges))
        assert raised.value.code == "NOT_FOUND"
        assert f"calibration '{calibration_id}' expired" in raised.value.details
        assert raised.value.details.endswith("calibrate again")
        layers: list[int] = []
        again = client.calibrate_language_model(
            request, on_progress=lambda p: layers.append(p.layer)
        )
    assert again.calibration_id == calibration_id
    assert again.resumed_at_layer == 0 and layers == list(range(LAYERS))


def test_a_server_refuses_bad_calibrations_with_what_to_fix(make_server, llama, ids):
    server = make_server()
    bad_ids = _message(ids, calibration_ids=_inline(np.full((2, 8), VOCAB + 5, np.int32)))
    with Client(server.address, timeout=60) as client:
        request = _lm_request(client, llama, bad_ids)
        with pytest.raises(errors.QmillError) as raised:
            client.calibrate_language_model(request)
        assert raised.value.code == "INVALID_ARGUMENT"
        assert "outside the model's vocabulary of 256" in raised.value.details
        request = _lm_request(client, llama, _message(ids))
        request.weight_uploads["model.safetensors"] = "no-such-upload"
        with pytest.raises(errors.QmillError, match="NOT_FOUND"):
            client.calibrate_language_model(request)
        not_done = pb.StaticRanges(calibration_id="lm-" + "0" * 32)
        with pytest.raises(errors.QmillError, match="NOT_FOUND"):
            list(client.quantize(_recipe(), [("w", np.ones((4, 4), np.float32))],
                                 static_ranges=not_done))  # fmt: skip


def test_the_async_client_calibrates_and_refuses_as_the_client_does(make_server, llama, ids):
    import asyncio

    from qmill.client import AsyncClient

    server = make_server()
    with Client(server.address, timeout=60) as client:
        good = _lm_request(client, llama, _message(ids))
    bad = pb.CalibrateLanguageModelRequest()
    bad.CopyFrom(good)
    bad.calibration.method = "squeezellm"

    async def run() -> pb.CalibrateLanguageModelSummary:
        async with AsyncClient(server.address, timeout=60) as client:
            with pytest.raises(errors.QmillError, match="INVALID_ARGUMENT") as raised:
                await client.calibrate_language_model(bad)
            assert "not one of: gptq, awq" in raised.value.details
            layers: list[int] = []
            summary = await client.calibrate_language_model(
                good, on_progress=lambda p: layers.append(p.layer)
            )
            assert layers == list(range(LAYERS))
            return summary

    summary = asyncio.run(run())
    assert summary.resumed_at_layer == 0 and len(summary.calibrated_tensors) == 7 * LAYERS
    assert json.loads(summary.report_json)["perplexity"]["source"] > 0


def test_quantize_with_several_servers_is_refused_before_any_work(llama, ids, tmp_path, capsys):
    output = tmp_path / "out"
    args = _cli_args(llama, ids, output, "--server", "127.0.0.1:1,127.0.0.1:2")
    assert cli.main(args) == 1
    assert "--method gptq with --server takes one server" in capsys.readouterr().err
    assert not output.exists()


def test_awq_gptq_through_a_server_and_as_a_job_gives_the_in_process_bytes(
    make_server, llama, ids, tmp_path
):
    """The folded norms travel back (CalibrateLanguageModelResponse.folded) and are written in
    place of the source's, by the client's pipeline and by a job's."""

    def awq(output, *extra) -> list[str]:
        args = _cli_args(llama, ids, output, "--awq-grid", "4", *extra)
        return [*args[: args.index("gptq")], "awq+gptq", *args[args.index("gptq") + 1 :]]

    reference = tmp_path / "in-process"
    assert cli.main(awq(reference)) == 0
    server = make_server()
    output, report = tmp_path / "server", tmp_path / "report.json"
    assert cli.main(awq(output, "--server", server.address, "--report-json", report)) == 0
    _same_bytes(output, reference)
    methods = {row["path"]: row["method"] for row in json.loads(report.read_text())["tensors"]}
    assert sorted(methods.values()).count("AWQ+GPTQ") == 7 * LAYERS
    dest = tmp_path / "job"
    with Client(server.address, timeout=60) as client:
        job = _submit(client, llama, dest, _message(ids, method="awq+gptq", awq_grid=4))
        last = list(client.jobs.watch(job.job_id))[-1].job
    assert last.state == pb.JOB_STATE_SUCCEEDED, last.error
    assert "GPTQ loss by layer: " in last.message
    _same_bytes(dest, reference)


def test_qep_through_a_server_and_as_a_job_gives_the_in_process_bytes(
    make_server, llama, ids, tmp_path
):
    """QEP's correction travels (LanguageModelCalibration.qep_correction) and the server carries
    the float model's stream as the in-process run does."""

    def qep(output, *extra) -> list[str]:
        args = _cli_args(llama, ids, output, "--qep-correction", "0.75", *extra)
        args[args.index("gptq")] = "qep"
        return args

    reference = tmp_path / "in-process"
    assert cli.main(qep(reference)) == 0
    server = make_server()
    output, report = tmp_path / "server", tmp_path / "report.json"
    assert cli.main(qep(output, "--server", server.address, "--report-json", report)) == 0
    _same_bytes(output, reference)
    done = json.loads(report.read_text())
    methods = {row["path"]: row["method"] for row in done["tensors"]}
    assert sorted(methods.values()).count("QEP+GPTQ") == 7 * LAYERS
    assert done["calibration"]["qep"]["correction_factor"] == 0.75
    dest = tmp_path / "job"
    with Client(server.address, timeout=60) as client:
        job = _submit(client, llama, dest, _message(ids, method="qep", qep_correction=0.75))
        last = list(client.jobs.watch(job.job_id))[-1].job
    assert last.state == pb.JOB_STATE_SUCCEEDED, last.error
    _same_bytes(dest, reference)


def test_hadamard_through_a_server_and_as_a_job_gives_the_in_process_bytes(
    make_server, llama, ids, tmp_path
):
    """The rotation's seed travels (LanguageModelCalibration.hadamard_seed), the rotated
    embedding, norms and untied head come back as folded tensors, and the client's plan and a
    job's write the tied Llama's head as a tensor of its own."""

    def hadamard(output, *extra) -> list[str]:
        args = _cli_args(llama, ids, output, "--hadamard-seed", "7", *extra)
        args[args.index("gptq")] = "hadamard"
        return args

    reference = tmp_path / "in-process"
    assert cli.main(hadamard(reference)) == 0
    assert json.loads((reference / "config.json").read_text())["tie_word_embeddings"] is False
    server = make_server()
    output, report = tmp_path / "server", tmp_path / "report.json"
    assert cli.main(hadamard(output, "--server", server.address, "--report-json", report)) == 0
    _same_bytes(output, reference)
    done = json.loads(report.read_text())
    methods = {row["path"]: row["method"] for row in done["tensors"]}
    assert sorted(methods.values()).count("Hadamard") == 7 * LAYERS
    assert "lm_head.weight" in methods and done["calibration"]["hadamard"]["seed"] == 7
    dest = tmp_path / "job"
    with Client(server.address, timeout=60) as client:
        job = _submit(client, llama, dest, _message(ids, method="hadamard", hadamard_seed=7))
        last = list(client.jobs.watch(job.job_id))[-1].job
    assert last.state == pb.JOB_STATE_SUCCEEDED, last.error
    _same_bytes(dest, reference)


def test_gptq_of_a_micro_scaled_scheme_is_refused_before_any_work_on_every_path(
    make_server, llama, ids, tmp_path, capsys
):
    """MXFP8 (E8M0 group scales) is refused by the one check (lm_methods.check_recipe) in
    process, by the client of --server, by CalibrateLanguageModel and by SubmitJob: one line
    naming what runs instead, nothing written, no job."""
    server = make_server()
    words = "--method gptq cannot calibrate MXFP8: mxfp8 rounds each group's scale"
    for where in ((), ("--server", server.address)):
        output = tmp_path / f"out{len(where)}"
        args = _cli_args(llama, ids, output, *where)
        del args[args.index("--group-size") : args.index("--group-size") + 2]
        args[args.index("W4A16")] = "MXFP8"
        assert cli.main(args) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and "W4A16, W4A16_ASYM" in err, err
        assert not output.exists() and not lm_calibration.work_directory(output).exists()
    mxfp8 = recipes.load("MXFP8")
    with Client(server.address, timeout=60) as client:
        request = _lm_request(client, llama, _message(ids))
        request.recipe.CopyFrom(recipes.message(mxfp8))
        with pytest.raises(errors.QmillError) as raised:
            client.calibrate_language_model(request)
        assert raised.value.code == "INVALID_ARGUMENT" and words in raised.value.details
        dest = tmp_path / "job"
        with pytest.raises(errors.QmillError) as raised:
            client.jobs.submit(
                str(llama), str(dest), mxfp8, output_format="compressed-tensors",
                language_model=_message(ids),
            )  # fmt: skip
        assert raised.value.code == "INVALID_ARGUMENT" and words in raised.value.details
        assert client.jobs.list() == [] and not lm_calibration.work_directory(dest).exists()
