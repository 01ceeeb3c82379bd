"""What serving stacks make of a Hugging Face folder qmill wrote, said when it is written.

A folder in qmill's own layout (`P/array/qvalue`, `quant_method: "qmill"`) is read by
`qmill.checkpoints.load` and by nothing else: transformers does not know the quantization method,
logs one warning, skips it and builds the model with random weights in place of every quantized
one (rc 0; perplexity 1041.7 instead of 43.5 on a small Llama); vLLM refuses the unknown method.
The compressed-tensors schemes are the layout they load: the user is told which one fits.
"""

from __future__ import annotations

import json
import pathlib

# The compressed-tensors scheme with the same kind of weight codes as each preset.
SCHEME_FOR_PRESET = {
    "int4": "W4A16 (int4 codes in groups of 128, as int4)",
    "int8": "W8A16 (int8 weights; W8A8 also quantizes activations per token)",
    "fp8": "FP8_DYNAMIC (fp8 e4m3 weights per channel, as fp8)",
    "nf4": "W4A16 (int4 in groups of 128: no serving stack loads nf4 codes)",
}


def qmill_layout_warning(output: str, recipe: str) -> str | None:
    """The warning for a Hugging Face model folder written in qmill's own layout, naming the
    `--recipe` that serving stacks load instead; None for any other output."""
    config = pathlib.Path(output) / "config.json"
    try:
        method = json.loads(config.read_text()).get("quantization_config", {}).get("quant_method")
    except (OSError, ValueError, AttributeError):
        return None
    if method != "qmill":
        return None
    instead = SCHEME_FOR_PRESET.get(
        recipe.lower(), "a compressed-tensors scheme (W4A16, W8A16, W8A8, FP8_DYNAMIC, ...)"
    )
    return (
        f"qmill: warning: {output} is in qmill's own layout, which only qmill.checkpoints.load "
        "reads: transformers loads it WITHOUT an error as random weights in place of the "
        "quantized ones, and vLLM refuses it. To serve it with transformers, vLLM or SGLang, "
        f"quantize with --recipe {instead}"
    )
