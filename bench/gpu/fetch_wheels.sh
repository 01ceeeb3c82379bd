#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the wheels bench/gpu/setup.sh installs on a lent GPU machine
# (Python 3.12, x86_64, no network there): qmill's server-side pins, so versions do not depend on
# the image, and the reference Qwix 0.1.8 for tests/engine/device_parity.py (a black-box oracle,
# never a dependency of qmill) with what it needs beyond jax and flax. ~8.4 MB in all; the whole
# tree travels within 64 MiB. Run from the repository root on a machine with network.
set -euo pipefail
PY=${PY:-python3}
WANT=(
    grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2
    google-crc32c==1.9.0 google-re2==1.1.20251105 flatbuffers==25.12.19
    qwix==0.1.8 opt_einsum==3.4.0 absl-py==2.5.1 threadpoolctl==3.6.0
)
for want in "${WANT[@]}"; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d .whl "$want"
done
du -sh .whl
