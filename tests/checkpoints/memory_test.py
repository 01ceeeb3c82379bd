"""Memory stays bounded by a few tensors, not the checkpoint: a 512 MiB checkpoint of 16 MiB
tensors is written and read back in a fresh process whose peak RSS is measured."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

TENSOR_BYTES = 16 * 2**20
COUNT = 32  # 512 MiB in all
# Orbax saves groups of leaves (2 groups resident at worst) and tensorstore keeps a read
# cache of up to 100 MB: a constant, still far below the checkpoint's size.
LIMITS = {"safetensors": 4 * TENSOR_BYTES, "npz": 4 * TENSOR_BYTES, "orbax": 16 * TENSOR_BYTES}

SCRIPT = """
import json, sys
import numpy as np
from qmill import checkpoints

def rss(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))

fmt, dest, tensor_bytes, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if fmt == "orbax":
    import orbax.checkpoint  # imported up front: its import is not the writer's memory
    from qmill.checkpoints.formats.orbax import writer as orbax_writer
    orbax_writer.GROUP_BYTES = 2 * tensor_bytes
base = rss("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM, the peak RSS, to the current RSS
with checkpoints.create_writer(dest, fmt) as writer:
    for i in range(count):
        writer.write(f"layers/{i}/w", np.full(tensor_bytes // 4, i, np.float32))
written = rss("VmHWM") - base
with checkpoints.open_source(dest) as source:
    for e in source.entries():
        assert source.read(e.path)[-1] == int(e.path.split("/")[1])
print(json.dumps({"write": written, "total": rss("VmHWM") - base}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
@pytest.mark.parametrize("fmt", sorted(LIMITS))
def test_peak_memory_is_bounded_by_a_few_tensors(tmp_path, fmt):
    dest = tmp_path / {"orbax": "c", "safetensors": "c.safetensors", "npz": "c.npz"}[fmt]
    args = [sys.executable, "-c", SCRIPT, fmt, str(dest), str(TENSOR_BYTES), str(COUNT)]
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        peak = json.loads(result.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)  # 512 MiB pytest would otherwise keep
    assert peak["total"] < LIMITS[fmt], peak
    assert peak["total"] < COUNT * TENSOR_BYTES / 2, peak
