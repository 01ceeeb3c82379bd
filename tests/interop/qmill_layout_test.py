"""Every Hugging Face folder qmill writes, loaded by transformers: it runs the quantized weights
(the compressed-tensors schemes: ct_write_test.py), or qmill said loudly when writing it that
transformers and vLLM do not read it (qmill's own layout, issue 38).

transformers 5 loads a folder whose quant_method it does not know with one logged warning and
random weights in place of the quantized ones; nothing in the folder can make it refuse without
breaking qmill's own layout, so the warning is qmill's, at the moment the folder is written.
"""

from __future__ import annotations

import pytest

from qmill.cli import main as cli


def _weights(folder):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return {k: v for k, v in model.state_dict().items() if k.endswith("proj.weight")}


@pytest.mark.parametrize(
    ("recipe", "scheme"), [("int4", "W4A16"), ("int8", "W8A16"), ("fp8", "FP8_DYNAMIC")]
)
def test_qmill_layout_is_loaded_as_noise_by_transformers_and_qmill_says_so(
    tmp_path, llama, capsys, recipe, scheme
):
    out = tmp_path / "out"
    assert cli.main(["quantize", str(llama), "-o", str(out), "--recipe", recipe, "-q"]) == 0
    warning = capsys.readouterr().err
    assert "warning" in warning and "transformers loads it WITHOUT an error" in warning
    assert f"--recipe {scheme}" in warning
    # What the warning is about: transformers' weights are neither the quantized ones nor the
    # source's (which the quantized ones are within a few percent of), but its random init.
    name = "model.layers.0.mlp.up_proj.weight"
    loaded, source = _weights(out)[name], _weights(llama)[name]
    assert (loaded - source).norm() > 0.5 * source.norm()


def test_a_compressed_tensors_folder_gets_no_warning(tmp_path, llama, capsys):
    out = tmp_path / "out"
    assert cli.main(["quantize", str(llama), "-o", str(out), "--recipe", "W4A16", "-q"]) == 0
    assert "warning" not in capsys.readouterr().err
