"""GPTQ through `qmill quantize --method gptq` for every family the forward pass reads, not only
Llama: biases (Qwen2), fused q/k/v and gate/up (Phi-3), q/k norms (Qwen3), sandwich norms,
soft-caps and sliding layers (Gemma 2). The written compressed-tensors folder is loaded by
transformers, which must measure the perplexity qmill reported: every linear was found, cut
into the right stage, GPTQ'd and written where transformers reads it."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from qmill.cli import main as cli
from tests import lm_folder

SMALL = lm_folder.SMALL
CASES = {
    "qwen2": ("Qwen2Config", dict(SMALL), 7),
    "qwen3": ("Qwen3Config", dict(SMALL, head_dim=16), 7),
    "phi3": ("Phi3Config", dict(SMALL, pad_token_id=0, eos_token_id=1), 4),
    "gemma2": (
        "Gemma2Config",
        dict(SMALL, head_dim=16, sliding_window=5, query_pre_attn_scalar=16),
        7,
    ),
}


def _folder(name: str, root: pathlib.Path) -> pathlib.Path:
    config_class, fields, _ = CASES[name]
    return lm_folder.write(root / name, config_class, fields)


@pytest.mark.parametrize("name", sorted(CASES))
def test_gptq_output_loads_with_the_reported_perplexity(name, tmp_path, capsys):
    import torch
    import transformers

    folder = _folder(name, tmp_path)
    rng = np.random.default_rng(1)
    for part, shape in (("cal", (8, 16)), ("eval", (4, 16))):
        np.save(tmp_path / f"{part}.npy", rng.integers(0, 256, shape).astype(np.int32))
    output, report = tmp_path / "out", tmp_path / "report.json"
    rc = cli.main(
        ["quantize", str(folder), "-o", str(output), "--recipe", "W4A16", "--group-size", "32",
         "--method", "gptq", "--calibration-ids", str(tmp_path / "cal.npy"),
         "--eval-ids", str(tmp_path / "eval.npy"), "--report-json", str(report), "-q"]
    )  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    rows = json.loads(report.read_text())
    gptq = [r["path"] for r in rows["tensors"] if r["method"] == "GPTQ"]
    assert len(gptq) == CASES[name][2] * SMALL["num_hidden_layers"], gptq

    model = transformers.AutoModelForCausalLM.from_pretrained(
        output, dtype=torch.float32, attn_implementation="eager"
    )
    ids = torch.tensor(np.load(tmp_path / "eval.npy"), dtype=torch.long)
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    # float32 on both sides from the same codes × scales; summation order only (1e-4 is ~100×
    # what the Llama tests measure).
    assert rows["perplexity"]["quantized"] == pytest.approx(np.exp(loss), rel=1e-4)
