# Sourced on the device machine: wheels from .whl (bench/gpu/fetch_wheels.sh), qmill importable
# through a package-dir shim (qmill is a namespace package: one link per part).
#   PY           the interpreter (default python3: the image's, with jax + CUDA)
#   QMILL_WHEELS the wheels to install (default: every .whl/*.whl)
#   QMILL_GPU_TMP where the site and the shim go (default /tmp)
PY=${PY:-python3}
QMILL_GPU_TMP=${QMILL_GPU_TMP:-/tmp}
# shellcheck disable=SC2086  # a list of paths
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$QMILL_GPU_TMP/site" ${QMILL_WHEELS:-.whl/*.whl} ||
    echo "setup.sh: installing the wheels FAILED; going on with the image's packages" >&2
mkdir -p "$QMILL_GPU_TMP/q/qmill"
for d in engine server client proto checkpoints cli; do
    ln -sfn "$PWD/$d" "$QMILL_GPU_TMP/q/qmill/$d"
done
# The distribution's metadata, which the CLI, capabilities and written configs read the version
# from (importlib.metadata), as an install would leave it.
QMILL_VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
mkdir -p "$QMILL_GPU_TMP/q/qmill-$QMILL_VERSION.dist-info"
printf 'Metadata-Version: 2.1\nName: qmill\nVersion: %s\n' "$QMILL_VERSION" \
    >"$QMILL_GPU_TMP/q/qmill-$QMILL_VERSION.dist-info/METADATA"
export PYTHONPATH=$QMILL_GPU_TMP/site:$QMILL_GPU_TMP/q PYTHONUNBUFFERED=1
