"""What a language model's layer-by-layer calibration holds in memory at its peak, by part: what
`--dry-run` prints and `--max-memory` is checked against, before any work."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from qmill.checkpoints.lm import methods as lm_methods


def estimate(cfg: Any, entries: Mapping[str, Any], request: Any) -> dict[str, int]:
    """Bytes the calibration holds at its peak, by part (float32 throughout).

    entries: tensor name → (shape) of the folder's tensors.
    """
    from qmill.engine.lm import config as config_lib

    def size(name: str) -> int:
        return 4 * math.prod(entries[name]) if name in entries else 0

    layer = max(
        sum(size(n) for n in config_lib.layer_tensor_names(cfg, i)) for i in range(cfg.num_layers)
    )
    outer = sum(size(n) for n in config_lib.outer_tensor_names(cfg).values() if n)
    samples, tokens = request.calibration_ids.shape
    widest = max(cfg.hidden_size, cfg.intermediate_size)
    # Hidden states in and out, one stage's input for every sample, and its carry (residual).
    hidden = 4 * samples * tokens * (3 * cfg.hidden_size + widest)
    evaluation = 0
    if request.eval_ids is not None:
        windows, length = request.eval_ids.shape
        # Two streams (float and quantized), and the logits of a slice of positions, which
        # the forward pass keeps under 32 MiB (and their softmax as much again).
        evaluation = 4 * (2 * windows * length * cfg.hidden_size)
        evaluation += min(4 * min(windows, request.chunk) * length * cfg.vocab_size, 2 << 25)
    hessian = 4 * widest * widest * 3  # H, its inverse factor, and the work copy
    parts = {
        "layer": 2 * layer,  # as read and in float32
        "embedding and head": outer,
        "hidden states": hidden,
        "evaluation": evaluation,
        "hessian": hessian,
    }
    if lm_methods.propagates_float(request.method):
        parts["float hidden states"] = hidden  # QEP's second stream, as large as the first
    if lm_methods.rotates(request.method):
        parts["rotated embedding and head"] = outer
    if lm_methods.smoothing(request.method) == "awq":
        # The float block's output for every sample, which each candidate is compared with.
        parts["awq search"] = 4 * samples * tokens * cfg.hidden_size
    return parts
