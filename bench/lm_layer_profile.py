"""Where a language-model calibration's time goes, stage by stage, for a few decoder layers.

    python bench/lm_layer_profile.py [--layers 3] [--samples 64] [--seq-len 512]

The same steps as engine/lm/sequential.calibrate_layer, timed one by one on a SmolLM2-shaped
folder with random bf16 weights (bench/gpu/lm_gptq.py writes it): for each stage k, `s<k>` the
forward of every chunk, `h<k>` the Hessian of its linears' input, `g<k>` GPTQ of its linears.
The first layer pays the compilations. Pin the cores as the machine to compare with has them,
e.g. `OPENBLAS_NUM_THREADS=2 JAX_PLATFORMS=cpu taskset -c 0,1 python bench/lm_layer_profile.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "gpu"))

import lm_gptq

from qmill.checkpoints.lm import calibration as lm_calibration
from qmill.client import recipes as client_recipes
from qmill.engine.contrib import gptq_core
from qmill.engine.contrib import leaf as contrib_leaf
from qmill.engine.lm import config as config_lib
from qmill.engine.lm import forward, hessian, sequential
from qmill.engine.modelfree import layout, recipes


def _rss_mb() -> float:
    """The process's resident memory now, in MB (Linux: /proc/self/statm)."""
    pages = int(pathlib.Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e6


def profile_layer(cfg, weights, recipe, layer, hidden, options) -> tuple[tuple, dict]:
    prefix = config_lib.layer_prefix(cfg, layer)
    current = {
        n.removeprefix(prefix): jax.numpy.asarray(weights.read(n))
        for n in config_lib.layer_tensor_names(cfg, layer)
    }
    plans = {}
    for name in config_lib.linear_names(cfg, layer):
        array = weights.read(name)
        plans[name.removeprefix(prefix)] = layout.plan_leaf(name, array.shape, array.dtype, recipe)
    carries = [{"h": h} for h in hidden]
    seconds = {}
    for index, stage in enumerate(forward.stages(cfg, layer)):
        t0 = time.perf_counter()
        for i, carry in enumerate(carries):  # in place, as calibrate_layer does
            carries[i] = forward.stage_fn(cfg, layer, index)(current, carry)
        del carry
        jax.block_until_ready(carries)
        seconds[f"s{index}"] = time.perf_counter() - t0
        seconds[f"s{index}_mb"] = _rss_mb()
        if not stage.linears:
            continue
        t0 = time.perf_counter()
        h = jax.block_until_ready(hessian.of([c["x"] for c in carries]))
        seconds[f"h{index}"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        done = contrib_leaf.gptq_static_leaves(
            [current[n] for n in stage.linears], [plans[n] for n in stage.linears], h, options
        )
        for name, (_, deq, _) in zip(stage.linears, done, strict=True):
            current[name] = deq
        seconds[f"g{index}"] = time.perf_counter() - t0
        seconds[f"g{index}_mb"] = _rss_mb()
    return tuple(c["h"] for c in carries), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    folder = pathlib.Path(tempfile.mkdtemp(prefix="qmill-lm-profile-")) / "model"
    lm_gptq.make_folder(folder, args.layers)
    cfg = lm_calibration.model_config(folder)
    weights = lm_calibration._open_weights(folder)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg.vocab_size, (args.samples, args.seq_len)).astype(np.int32)
    recipe = recipes.recipe_from_mapping(
        client_recipes.with_group_size(client_recipes.load("W4A16"), 64)
    )
    # Chunks of the calibration's own default size (LmRequest.chunk), not a second constant.
    chunk = {f.name: f.default for f in dataclasses.fields(lm_calibration.LmRequest)}["chunk"]
    hidden = sequential.embed(
        cfg, lm_calibration._outer(cfg, weights), sequential.split(ids, chunk)
    )
    for layer in range(args.layers):
        t0 = time.perf_counter()
        hidden, seconds = profile_layer(
            cfg, weights, recipe, layer, hidden, gptq_core.GptqOptions()
        )
        shown = " ".join(
            f"{k} {v:.0f}" if k.endswith("_mb") else f"{k} {v:.2f}" for k, v in seconds.items()
        )
        print(f"layer {layer}: {time.perf_counter() - t0:.2f} s ({shown})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
