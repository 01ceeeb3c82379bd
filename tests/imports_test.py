"""The allowed imports of ARCHITECTURE.md.

One documented extension: qmill.proto.wire needs numpy and ml_dtypes, because the byte layout of
tensors is part of the contract and client and server must share one implementation of it.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
THIRD_PARTY = {
    "numpy",
    "ml_dtypes",
    "jax",
    "jaxlib",
    "flax",
    "grpc",
    "grpc_health",
    "grpc_reflection",
    "google",
    "orbax",
    "safetensors",
    "rich",
    "optax",
    "etils",
    "tensorstore",
    "prometheus_client",
    "litert_converter",
    "ai_edge_litert",
    "re2",
}
ALLOWED = {
    # re2: recipe regexes arrive over the network and must match in linear time.
    "engine": {"jax", "flax", "numpy", "ml_dtypes", "re2", "qmill.engine"},
    "proto": {"google", "grpc", "qmill.proto", "numpy", "ml_dtypes"},
    "checkpoints": {"qmill.checkpoints", "numpy", "ml_dtypes", "safetensors"},
    "server": {
        "qmill.engine",
        "qmill.proto",
        "qmill.checkpoints",
        "qmill.server",
        "grpc",
        "grpc_health",
        "grpc_reflection",
        "orbax",
        "jax",
        "numpy",
        "prometheus_client",
        # Jobs on object-store URLs copy through etils.epath, Orbax's own storage layer (so no
        # new dependency; its gs:// and s3:// filesystems are the optional objectstore extra).
        "etils",
    },
    "client": {
        "qmill.proto",
        "qmill.checkpoints",
        "qmill.client",
        "grpc",
        "numpy",
        "ml_dtypes",
        "safetensors",
        "rich",
    },
    # The composition root: the only part that sees both client and server (the server lazily).
    "cli": {"qmill.cli", "qmill.client", "qmill.checkpoints", "rich"},
}
# Imported inside functions only, on use (checked below).
LAZY = {
    # The in-process engine and Orbax's reader and writer.
    "checkpoints": {"qmill.engine", "orbax", "jax"},
    "client": {"orbax", "jax"},
    "cli": {"qmill.server"},
    # The LiteRT converter and schema for ExportOdml: large, from the optional qmill[odml] extra,
    # so imported on use and a server without them still serves everything else.
    "server": {"litert_converter", "ai_edge_litert"},
}


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "qmill":
            names = [f"qmill.{a.name}" for a in node.names]  # from qmill import checkpoints
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        top_level = node.col_offset == 0
        for name in names:
            yield name, top_level


def _allowed(name: str, allowed: set[str]) -> bool:
    return any(name == a or name.startswith(a + ".") for a in allowed)


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_parts_import_only_what_architecture_allows(part):
    bad = []
    for path in (ROOT / part).rglob("*.py"):
        if (
            path.name == "generate.py"
            or path.name.endswith("_pb2_grpc.py")
            or path.name.endswith("_pb2.py")
        ):
            continue
        for name, top_level in _imports(path):
            root = name.split(".")[0]
            if root not in THIRD_PARTY and root != "qmill":
                continue  # standard library
            if _allowed(name, ALLOWED[part]):
                continue
            if not top_level and _allowed(name, LAZY.get(part, set())):
                continue
            bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert not bad, "forbidden imports:\n" + "\n".join(bad)


def test_importing_the_client_does_not_import_jax():
    code = (
        "import sys, qmill.client, qmill.cli.main, qmill.client.commands, qmill.client.client; "
        "import qmill.checkpoints, qmill.checkpoints.pipeline, qmill.checkpoints.embedded; "
        "sys.exit(1 if 'jax' in sys.modules or 'orbax' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
