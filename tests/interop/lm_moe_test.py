"""`qmill quantize --method gptq` on mixtures of experts that transformers writes (Mixtral;
Qwen3-MoE with a dense layer among its sparse ones): the output loads in transformers with the
perplexity qmill reported, every expert's scales are finite and positive, the routers stay in
the source dtype, an expert no calibration token reaches is round to nearest and named in the
report, and --calibrate-all-experts GPTQs every expert."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import safetensors
from safetensors.numpy import load_file

from qmill.cli import main as cli
from tests import lm_folder

VOCAB = lm_folder.VOCAB
MODELS = {
    "mixtral": ("MixtralConfig", dict(lm_folder.MIXTRAL, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(lm_folder.QWEN3_MOE, num_experts_per_tok=2)),
}


def _folder(name: str, root: pathlib.Path) -> pathlib.Path:
    config_class, fields = MODELS[name]
    return lm_folder.write(root / name, config_class, fields)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("moe")
    rng = np.random.default_rng(1)
    for part, shape in (("cal", (4, 16)), ("eval", (2, 16))):
        np.save(root / f"{part}.npy", rng.integers(0, VOCAB, shape).astype(np.int32))
    # Two tokens, two experts each: at most 4 of Qwen3-MoE's 8 experts see one.
    np.save(root / "tiny.npy", np.array([[5, 77]], np.int32))
    return root


def _quantize(folder, output, calibration, *extra) -> dict:
    report = output.with_suffix(".json")
    rc = cli.main(
        ["quantize", str(folder), "-o", str(output), "--recipe", "W4A16", "--group-size", "32",
         "--method", "gptq", "--calibration-ids", str(calibration), "--report-json",
         str(report), "-q", *map(str, extra)]
    )  # fmt: skip
    assert rc == 0
    return json.loads(report.read_text())


def _experts(rows: list[dict]) -> dict[str, str]:
    return {r["path"]: r["method"] for r in rows["tensors"] if ".experts." in r["path"]}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gptq_output_loads_with_the_reported_perplexity(name, root):
    import torch
    import transformers

    folder = _folder(name, root)
    # Qwen3-MoE on two tokens: some experts get none (the next test says which are RTN).
    calibration = root / ("tiny.npy" if name == "qwen3_moe" else "cal.npy")
    output = root / f"{name}-gptq"
    report = _quantize(folder, output, calibration, "--eval-ids", root / "eval.npy")
    experts = _experts(report)
    experts_per_layer = 3 * MODELS[name][1].get("num_local_experts", 8)
    assert len(experts) == experts_per_layer * (1 if name == "qwen3_moe" else 2)
    if name == "mixtral":
        assert set(experts.values()) == {"GPTQ"}, experts
    routers = [
        r for r in report["tensors"] if r["path"].endswith(("moe.gate.weight", "mlp.gate.weight"))
    ]
    assert routers and all(r["method"] == "" and r["qtype"] == "kept" for r in routers)

    written = {}
    for path in output.glob("*.safetensors"):
        written.update(load_file(path))
    scales = {k: v for k, v in written.items() if ".experts." in k and k.endswith("weight_scale")}
    assert len(scales) == len(experts)
    for key, scale in scales.items():
        scale = scale.astype(np.float32)
        assert np.all(np.isfinite(scale)) and np.all(scale > 0), key

    model = transformers.AutoModelForCausalLM.from_pretrained(
        output, dtype=torch.float32, attn_implementation="eager"
    )
    # transformers 5.17 leaves the kept (bf16) routers of a compressed-tensors folder in bf16
    # whatever `dtype` says, and then fails to multiply them with float32 states.
    for param in model.parameters():
        if param.dtype == torch.bfloat16:
            param.data = param.data.float()
    ids = torch.tensor(np.load(root / "eval.npy"), dtype=torch.long)
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    # float32 on both sides from the same codes × scales; summation order only.
    ppl = report["perplexity"]
    assert ppl["quantized"] == pytest.approx(np.exp(loss), rel=1e-4)
    # Close to the float model's: 4-bit groups of 32 on random weights move it by ~0.2 %
    # (measured 0.01-0.2 %); a block computed wrongly (an expert's output lost, the routing
    # taken from quantized weights) moves it by several %.
    assert ppl["quantized"] == pytest.approx(ppl["source"], rel=0.02)


def test_an_expert_without_tokens_is_rtn_and_all_experts_gptqs_every_one(root):
    folder = root / "qwen3_moe"  # written by the test above
    if not folder.is_dir():
        folder = _folder("qwen3_moe", root)
    report = _quantize(folder, root / "routed", root / "tiny.npy")
    experts = _experts(report)
    rtn = report["calibration"]["round_to_nearest"]
    # Two tokens, top 2 of 8: at least 4 experts got none; their three linears are RTN, with
    # the reason in the report; the others GPTQ.
    assert len(rtn) >= 12 and len(rtn) % 3 == 0
    assert {experts[name] for name in rtn} == {"RTN"}
    assert all("no calibration token" in why for why in rtn.values())
    assert {m for name, m in experts.items() if name not in rtn} == {"GPTQ"}

    every = _quantize(folder, root / "every", root / "tiny.npy", "--calibrate-all-experts")
    assert set(_experts(every).values()) == {"GPTQ"}
    assert every["calibration"]["round_to_nearest"] == {}
    assert every["calibration"]["calibrate_all_experts"] is True


def test_all_experts_through_a_server_and_as_a_job_gives_the_in_process_bytes(root, make_server):
    """--calibrate-all-experts on the wire (LanguageModelCalibration.calibrate_all_experts) and
    in a job's stored request: the server and a job write the in-process output (the test
    above's), every expert GPTQ'd; a flag dropped on the way leaves 4+ experts round to nearest
    and other bytes. The job's recipe lacks the router rule, which the server adds."""
    from qmill.checkpoints.lm import calibration as lm_calibration
    from qmill.checkpoints.lm import plans as lm_plans
    from qmill.cli import lm_jobs
    from qmill.client import Client, recipes
    from qmill.proto.v1 import qmill_pb2 as pb

    folder, tiny = root / "qwen3_moe", root / "tiny.npy"
    if not folder.is_dir():
        folder = _folder("qwen3_moe", root)
    reference = root / "every"
    if not reference.is_dir():
        _quantize(folder, reference, tiny, "--calibrate-all-experts")
    server = make_server()
    remote = _quantize(folder, root / "every-server", tiny, "--calibrate-all-experts",
                       "--server", server.address)  # fmt: skip
    assert remote["calibration"]["round_to_nearest"] == {}
    request = lm_calibration.LmRequest(calibration_ids=np.load(tiny), all_experts=True)
    # The job's recipe has no router rule: the server keeps the routers in the source dtype
    # all the same (lm_plans.keeping_routers), so its bytes are the preset's.
    recipe = recipes.with_group_size(recipes.load("W4A16"), 32)
    recipe["rules"] = [r for r in recipe["rules"] if r != lm_plans.ROUTERS_KEPT]
    with Client(server.address, timeout=60) as client:
        job = client.jobs.submit(
            str(folder), str(root / "every-job"), recipe,
            output_format="compressed-tensors", language_model=lm_jobs.message(request),
        )  # fmt: skip
        last = list(client.jobs.watch(job.job_id))[-1].job
    assert last.state == pb.JOB_STATE_SUCCEEDED, last.error
    assert json.loads(last.calibration_report_json)["calibration"]["round_to_nearest"] == {}
    for output in (root / "every-server", root / "every-job"):
        for path in reference.glob("*.safetensors"):
            assert (output / path.name).read_bytes() == path.read_bytes(), (output, path.name)


# FP8 on the experts alone (the rest in float: fewer shapes to compile).
FP8_EXPERTS = """scheme = "FP8"
[[rules]]
path_regex = '.*\\.experts\\..*'
qtype = "float8_e4m3fn"
contracting_axes = [1]
channel_axes = []
arithmetic = "torch"
[[rules]]
path_regex = '.*'
skip = true
"""


def test_static_input_scales_of_experts_no_token_reached_need_all_experts(root, capsys):
    """FP8's input scales of the tiny Qwen3-MoE's experts over two tokens: experts no token is
    routed to have no input range, and the run is refused naming the flag, writing nothing;
    with --calibrate-all-experts every expert sees every token, so every expert's gate and up
    share one input scale (the block's input over every token), finite and positive."""
    from qmill.checkpoints.lm import calibration as lm_calibration

    folder, tiny = root / "qwen3_moe", root / "tiny.npy"
    if not folder.is_dir():
        folder = _folder("qwen3_moe", root)
    recipe, output = root / "fp8-experts.toml", root / "fp8"
    recipe.write_text(FP8_EXPERTS)
    args = ["quantize", str(folder), "-o", str(output), "--recipe", str(recipe), "--format",
            "compressed-tensors", "--calibration-ids", str(tiny), "-q"]  # fmt: skip
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert (
        "no calibration token was routed to its expert" in err and "--calibrate-all-experts" in err
    )
    assert not output.exists() and not lm_calibration.work_directory(output).exists()
    assert cli.main([*args, "--calibrate-all-experts"]) == 0
    inputs = {}
    for path in output.glob("*.safetensors"):
        with safetensors.safe_open(path, "pt") as f:  # numpy has no float8 for the weights
            names = [k for k in f.keys() if ".experts." in k and k.endswith("input_scale")]  # noqa: SIM118
            inputs |= {k: f.get_tensor(k).float().numpy() for k in names}
    assert len(inputs) == 3 * MODELS["qwen3_moe"][1]["num_experts"]
    assert all(np.all(np.isfinite(v)) and np.all(v > 0) for v in inputs.values())
    gate_up = {v.tobytes() for k, v in inputs.items() if not k.endswith("down_proj.input_scale")}
    assert len(gate_up) == 1


# W4A16 in groups of 32 written as a user's recipe file: no rule for the routers.
CUSTOM_RECIPE = """scheme = "W4A16"
[[rules]]
path_regex = '(?i).*(embed|lm_head|norm).*'
skip = true
[[rules]]
path_regex = '.*\\.weight'
qtype = "int4"
tile_size = 32
arithmetic = "torch"
"""


def test_a_recipe_without_a_router_rule_leaves_the_routers_in_the_source_dtype(root):
    """The calibration keeps a mixture of experts' routers in the source dtype whatever the
    recipe says (lm_plans.keeping_routers): the report's rows say kept and why, the output's
    config ignores them, and they are the source's bytes."""
    folder, tiny = root / "qwen3_moe", root / "tiny.npy"
    if not folder.is_dir():
        folder = _folder("qwen3_moe", root)
    recipe = root / "custom.toml"
    recipe.write_text(CUSTOM_RECIPE)
    output, report_file = root / "custom", root / "custom.json"
    args = ["quantize", str(folder), "-o", str(output), "--recipe", str(recipe), "--method",
            "gptq", "--calibration-ids", str(tiny), "--report-json", str(report_file),
            "--format", "compressed-tensors", "-q"]  # fmt: skip
    assert cli.main(args) == 0
    rows = {r["path"]: r for r in json.loads(report_file.read_text())["tensors"]}
    router = "model.layers.1.mlp.gate.weight"  # layer 0 is a dense MLP
    assert rows[router]["qtype"] == "kept" and rows[router]["method"] == ""
    assert "shared_expert_gate" in rows[router]["reason"], rows[router]  # the rule's regex
    assert rows["model.layers.1.mlp.experts.0.gate_proj.weight"]["method"] == "GPTQ"
    config = json.loads((output / "config.json").read_text())
    assert "model.layers.1.mlp.gate" in config["quantization_config"]["ignore"]
    with safetensors.safe_open(folder / "model.safetensors", "pt") as f:
        source = f.get_tensor(router)
    with safetensors.safe_open(output / "model.safetensors", "pt") as f:
        assert f.get_tensor(router).equal(source)
