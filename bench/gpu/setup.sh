# Sourced on the device machine: wheels from .whl, qmill importable via a package-dir shim.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/q/qmill
for d in engine server client proto; do ln -sfn "$PWD/$d" /tmp/q/qmill/$d; done
export PYTHONPATH=/tmp/site:/tmp/q PYTHONUNBUFFERED=1
