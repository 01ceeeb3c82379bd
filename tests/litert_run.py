"""A .tflite model run in LiteRT's interpreter, one example at a time (the ODML export tests)."""

from __future__ import annotations

from typing import Any

import numpy as np


def interpreter(tflite: bytes) -> Any:
    """LiteRT's interpreter for the model, its tensors allocated."""
    from ai_edge_litert.interpreter import Interpreter  # the optional qmill[odml] dependency

    model = Interpreter(model_content=tflite)
    model.allocate_tensors()
    return model


def outputs(model: Any, x: np.ndarray) -> np.ndarray:
    """The model's output for each example of `x` (fed as a batch of one), stacked."""
    inp = model.get_input_details()[0]["index"]
    out = model.get_output_details()[0]["index"]
    results = []
    for i in range(len(x)):
        model.set_tensor(inp, x[i : i + 1])
        model.invoke()
        results.append(model.get_tensor(out)[0].copy())
    return np.stack(results)
