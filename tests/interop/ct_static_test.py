"""The static-activation presets (FP8, NVFP4): `qmill quantize FOLDER --recipe FP8
--calibration-ids IDS` against llm-compressor's `oneshot` (QuantizationModifier, the same
scheme) on the same tiny Llama and the same token ids.

The weights and their scales are equal bit for bit (rounded to nearest by both). The calibrated
input scales are compared within a tolerance, because the two run the model differently: the
peer runs it in bfloat16 (each matmul's output, the attention and the residual stream rounded to
bf16), qmill's forward pass in float32 from the same bf16 weights. The inputs of layer 0's
q/k/v (the embedding through one RMSNorm, which both compute in float32 and round to bf16) are
the same numbers, so their scales are equal bit for bit; deeper inputs differ by bf16 rounding
(~2⁻⁸ relative per operation), which moves an input's absmax, once rounded to bf16, by an ulp
or two of bf16 (2⁻⁷ relative each; 2 ulps on this model). 3 ulps is the bound.
"""

from __future__ import annotations

import pathlib
import re
import warnings

import numpy as np
import pytest

from qmill.checkpoints import (
    ct_activations,
    embedded,
    hf_folder,
    lm_activations,
    lm_calibration,
    pipeline,
)
from qmill.checkpoints.quantization_config import describe as describe_config
from qmill.cli import main as cli
from qmill.client import recipes
from tests.interop.conftest import quantization_config, same_bits, tensors

INPUT_SCALES = ("input_scale", "input_global_scale")
BF16_ULPS = 3 * 2.0**-7


@pytest.fixture(scope="module")
def ids(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("ids") / "ids.npy"
    np.save(path, np.random.default_rng(0).integers(0, 512, (4, 16)).astype(np.int32))
    return path


@pytest.fixture(scope="module")
def oneshot_peer(llama, ids, tmp_path_factory):
    """oneshot_peer(scheme) -> llm-compressor's oneshot output folder (cached): its
    QuantizationModifier with the preset, the model as saved (bf16), every calibration
    sample whole."""
    made: dict[str, pathlib.Path] = {}

    def run(scheme: str) -> pathlib.Path:
        if scheme not in made:
            from datasets import Dataset
            from llmcompressor import oneshot as _oneshot
            from llmcompressor.modifiers.quantization import QuantizationModifier
            from tokenizers import Tokenizer, models
            from transformers import PreTrainedTokenizerFast

            calibration = np.load(ids)
            dataset = Dataset.from_dict(
                {
                    "input_ids": calibration.tolist(),
                    "attention_mask": np.ones_like(calibration).tolist(),
                }
            )
            # The ids are given: oneshot wants a processor all the same, never used on them.
            vocab = models.WordLevel(vocab={"[UNK]": 0}, unk_token="[UNK]")
            tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(vocab))
            out = tmp_path_factory.mktemp("oneshot") / scheme
            # Its model is on the CPU: it warns of offloaded modules it would save, none here.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Attempting to save a model with offloaded")
                _oneshot(
                    model=str(llama),
                    processor=tokenizer,
                    dataset=dataset,
                    recipe=QuantizationModifier(
                        targets="Linear", scheme=scheme, ignore=["lm_head"]
                    ),
                    num_calibration_samples=len(calibration),
                    max_seq_length=calibration.shape[1],
                    output_dir=str(out),
                )
            made[scheme] = out
        return made[scheme]

    return run


@pytest.mark.parametrize("scheme", ["FP8", "nvfp4"])
def test_static_schemes_equal_oneshot_within_the_calibration_tolerance(
    tmp_path, llama, ids, oneshot_peer, capsys, scheme
):
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    args = ["quantize", str(llama), "-o", str(out), "--recipe", scheme, "--calibration-ids"]
    assert cli.main([*args, str(ids)]) == 0
    assert "layer 2/2: activation ranges" in capsys.readouterr().err
    theirs_folder = oneshot_peer(scheme.upper())
    ours, theirs = tensors(out), tensors(theirs_folder)
    assert sorted(ours) == sorted(theirs)
    scales = [k for k in ours if k.endswith(INPUT_SCALES)]
    assert len(scales) == 14  # 7 Linear weights in each of 2 layers
    unequal = [k for k in ours if k not in scales and not same_bits(ours[k], theirs[k])]
    assert not unequal, unequal
    for name in scales:
        assert ours[name].dtype == theirs[name].dtype and ours[name].shape == (1,), name
        assert ours[name].item() == pytest.approx(theirs[name].item(), rel=BF16_ULPS), name
    first = "model.layers.0.self_attn.q_proj."
    assert [same_bits(ours[k], theirs[k]) for k in scales if k.startswith(first)] == [True]
    # The same config, but for the group's name: the scheme's (as model_free_ptq's), not
    # oneshot's "group_0".
    ours_qc, theirs_qc = quantization_config(out), quantization_config(theirs_folder)
    for qc in (ours_qc, theirs_qc):
        qc["config_groups"] = list(qc["config_groups"].values())
    assert ours_qc["ignore"] == ["lm_head", "model.embed_tokens"]
    assert theirs_qc["ignore"] == ["lm_head"]  # oneshot never quantizes an Embedding
    ours_qc.pop("ignore"), theirs_qc.pop("ignore")
    assert ours_qc == theirs_qc
    # Read back (qmill inspect), either folder says its scheme by the preset's name.
    for folder in (out, theirs_folder):
        shown = describe_config(hf_folder.read_config(folder))
        assert f"scheme {scheme.upper()}, format" in shown, shown
    # transformers runs it (quantizing each input with its static scale): as far from the float
    # model as the peer's is. (Not equal: a scale an ulp apart rounds many activations apart.)
    ids_t = torch.tensor([[1, 5, 9, 200, 33, 7, 411]])
    logits = []
    for folder in (out, theirs_folder, llama):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        with torch.no_grad():
            logits.append(model(ids_t).logits.float())
    ours_error, theirs_error = ((x - logits[2]).abs().mean().item() for x in logits[:2])
    assert ours_error == pytest.approx(theirs_error, rel=0.25) and ours_error > 0


def test_without_calibration_data_a_static_scheme_is_refused(tmp_path, llama, ids, capsys):
    out = tmp_path / "out"
    assert cli.main(["quantize", str(llama), "-o", str(out), "--recipe", "fp8", "-q"]) == 0
    capsys.readouterr()  # qmill's own fp8 preset: no calibration, qmill's layout
    no_data = "FP8 quantizes each Linear's input with a static input_scale calibrated on text"
    cases = {
        f"{no_data}.*pass --calibration-text FILE or --calibration-ids": [],
        "drop --method": ["--calibration-ids", str(ids), "--method", "gptq"],
        "drop --server": ["--calibration-ids", str(ids), "--server", "localhost:1"],
    }
    for expected, extra in cases.items():
        x = str(tmp_path / "x")
        assert cli.main(["quantize", str(llama), "-o", x, "--recipe", "FP8", *extra]) == 1
        assert re.search(expected, capsys.readouterr().err)
        assert not (tmp_path / "x").exists()
    # A job cannot calibrate: refused when submitted; and the writer refuses a weight that
    # comes without its input scale (an API caller's run), before anything is kept.
    with pytest.raises(ValueError, match=r"NVFP4 quantizes each Linear's input.*which a job"):
        ct_activations.refuse_uncalibrated(recipes.load("NVFP4"), "compressed-tensors", "a job")
    ct_activations.refuse_uncalibrated(recipes.load("NVFP4A16"), "compressed-tensors", "a job")
    with (
        embedded.EmbeddedClient() as client,
        pytest.raises(ValueError, match=r"_proj\.weight: NVFP4 quantizes each Linear's input"),
    ):
        pipeline.quantize_checkpoint(
            llama,
            tmp_path / "y",
            recipes.load("NVFP4"),
            backend=client,
            output_format="compressed-tensors",
        )
    assert not (tmp_path / "y").exists()  # nothing committed (the kept tensors wait for a rerun)
    assert not lm_calibration.work_directory(tmp_path / "x").exists()


def test_a_rerun_takes_the_kept_ranges_and_refuses_other_tokens(tmp_path, llama, ids, capsys):
    import ml_dtypes

    out = tmp_path / "out"
    # As a run killed while writing leaves them: the ranges kept beside the output.
    kept = lm_activations.kept_or_collect(str(llama), out, recipes.load("FP8"), np.load(ids))
    other = tmp_path / "other.npy"
    np.save(other, np.load(ids)[:2])
    args = ["quantize", str(llama), "-o", str(out), "--recipe", "FP8", "--calibration-ids"]
    assert cli.main([*args, str(other)]) == 1
    assert "pass --restart" in capsys.readouterr().err and not out.exists()
    assert cli.main([*args, str(ids)]) == 0
    assert "activation ranges" not in capsys.readouterr().err  # taken, not run again
    assert not lm_calibration.work_directory(out).exists()  # the output holds them now
    down = "model.layers.1.mlp.down_proj.weight"
    expected = ct_activations.fp8_input_scale(kept[down], ml_dtypes.bfloat16)
    assert tensors(out)[down.replace("weight", "input_scale")].item() == float(expected[0])
