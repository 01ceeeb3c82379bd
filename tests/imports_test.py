"""The allowed imports of docs/architecture.md, its engine rooms, and no import circles.

One documented extension: qmill.proto.wire needs numpy and ml_dtypes, because the byte layout of
tensors is part of the contract and client and server must share one implementation of it.
"""

import ast
import json
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
    "psycopg",
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
    # The `qmill` command and the composition root: the only part that sees both client and
    # server (the server lazily). Its commands build requests (proto) and read and write files.
    "cli": {
        "qmill.cli",
        "qmill.client",
        "qmill.checkpoints",
        "qmill.proto",
        "numpy",
        "ml_dtypes",
        "safetensors",
        "rich",
    },
}
# Imported inside functions only, on use (checked below).
LAZY = {
    # The in-process engine and Orbax's reader and writer.
    "checkpoints": {"qmill.engine", "orbax", "jax"},
    "client": {"orbax", "jax"},
    "cli": {"qmill.server"},
    # The LiteRT converter and schema for ExportOdml: large, from the optional qmill[odml] extra,
    # so imported on use and a server without them still serves everything else.
    "server": {"litert_converter", "ai_edge_litert", "psycopg"},
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
        "import sys, qmill.client, qmill.cli.main, qmill.cli.commands, qmill.client.client; "
        "import qmill.checkpoints, qmill.checkpoints.run.pipeline, qmill.checkpoints.run.embedded; "
        "sys.exit(1 if 'jax' in sys.modules or 'orbax' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_in_process_quantize_imports_no_flax(tmp_path):
    # Quantizing a checkpoint needs engine.modelfree and engine.core only: flax and what the
    # providers pull in (flax.nnx, optax, treescope) were ~0.4 s of the quick start (issue 28).
    source = ROOT / "examples" / "tiny-mlp"
    unwanted = "m.split('.')[0] in ('flax', 'optax', 'treescope') or " + (
        "m.startswith('qmill.engine.providers')"
    )
    assert _modules_after_quantize(source, tmp_path / "out", unwanted) == []
    assert (tmp_path / "out").is_dir()


def test_in_process_quantize_of_safetensors_imports_no_grpc_or_orbax(tmp_path):
    # A safetensors checkpoint quantized here opens no channel and no Orbax checkpoint: gRPC
    # (~40 ms) and Orbax (~0.2 s) are for --server and Orbax checkpoints only (issue 27).
    source, out = tmp_path / "model.safetensors", tmp_path / "out.safetensors"
    setup = (
        "import numpy as np; import safetensors.numpy as st; "
        f"st.save_file({{'w': np.ones((64, 128), np.float32)}}, {str(source)!r}); "
    )
    unwanted = "m.split('.')[0] in ('grpc', 'orbax', 'flax', 'optax')"
    assert _modules_after_quantize(source, out, unwanted, setup=setup) == []
    assert out.stat().st_size > 0


def _modules_after_quantize(source, out, unwanted: str, *, setup: str = "") -> list[str]:
    """The modules matching `unwanted` (an expression of m) that a fresh process has imported
    after `qmill quantize SOURCE -o OUT --recipe int8` run in it (after `setup`)."""
    code = (
        f"import json, sys; {setup}from qmill.cli import main; "
        f"rc = main.main(['quantize', {str(source)!r}, '-o', {str(out)!r}, "
        "'--recipe', 'int8', '-q']); "
        f"print(json.dumps(sorted(m for m in sys.modules if {unwanted}))); "
        "sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


SERVER_QUANTIZES = r"""
import asyncio, json, sys
import numpy as np, safetensors.numpy as st
from qmill.cli import main, serve
from qmill.proto import memory
from qmill.server import app, config

source, out, data_dir = sys.argv[1:4]
st.save_file({"w": np.ones((64, 128), np.float32), "b": np.ones(64, np.float32)}, source)
memory.limit_arenas()  # as `qmill serve` starts (server/command.py run)


async def run() -> int:
    cfg = config.ServerConfig(host="127.0.0.1", port=0, data_dir=data_dir, grace_seconds=0.5)
    server = await app.create_server(cfg, job_peer_backends=serve.job_peer_backends)
    address = f"127.0.0.1:{server.port}"
    try:
        argv = [["capabilities", "--server", address],
                ["quantize", source, "-o", out, "--recipe", "int8", "--server", address, "-q"]]
        for args in argv:
            if rc := await asyncio.to_thread(main.main, args):
                return rc
    finally:
        await server.stop(0.5)
    return 0


rc = asyncio.run(run())
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("flax", "optax"))))
sys.exit(rc)
"""


def test_a_server_that_quantizes_imports_no_flax_or_optax(tmp_path):
    # Flax, optax and their dependencies are ~10-18 MB of the server's memory (issue 27: its peak
    # RSS while quantizing); only the model registry's builds, calibration, ODML export and the
    # calibrated methods (GPTQ, AWQ, SmoothQuant) use them, and import them on first use. The
    # server starts as `qmill serve` does, answers GetCapabilities and quantizes a checkpoint
    # (the client runs in the same process: it imports neither either).
    source, out = tmp_path / "model.safetensors", tmp_path / "out.safetensors"
    argv = [sys.executable, "-c", SERVER_QUANTIZES, str(source), str(out), str(tmp_path / "data")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []
    assert out.stat().st_size > 0


# The engine's rooms, each allowed to import only itself and the rooms listed for it
# (docs/architecture.md, "The engine's rooms"). A room's name is its sub-package of engine/.
ENGINE_ROOMS = {
    "core": set(),
    "modeling": {"core"},
    "ops": {"core", "modeling"},
    "providers": {"core", "modeling", "ops"},
    "contrib": {"core", "modeling", "ops", "providers", "modelfree"},
    "modelfree": {"core", "modeling"},
    "programs": {"core", "modeling", "ops", "providers", "contrib"},
    "lm": {"core", "modeling", "ops", "providers", "contrib", "modelfree"},
}
# The checkpoint part's rooms (docs/architecture.md, "The checkpoint part's rooms"): a room is a
# sub-package of checkpoints/ (formats/' own modules, registry and examples, are the room
# "formats", above every format room).
_FORMAT_ROOMS = ("safetensors", "orbax", "npz", "hf_folder", "compressed_tensors")
CHECKPOINT_ROOMS = {
    "base": set(),
    "formats.safetensors": {"base"},
    "formats.orbax": {"base"},
    "formats.npz": {"base"},
    "formats.hf_folder": {"base", "formats.safetensors"},
    "formats.compressed_tensors": {"base", "formats.safetensors", "formats.hf_folder"},
    "formats": {"base", *(f"formats.{r}" for r in _FORMAT_ROOMS)},
    "run": {"base", "formats", *(f"formats.{r}" for r in _FORMAT_ROOMS)},
    "loading": {"base", "formats", *(f"formats.{r}" for r in _FORMAT_ROOMS)},
    "lm": {"base", "formats", "run", *(f"formats.{r}" for r in _FORMAT_ROOMS)},
    "programs": set(),
}
PART_PACKAGES = {
    "engine": "qmill.engine",
    "client": "qmill.client",
    "checkpoints": "qmill.checkpoints",
    "cli": "qmill.cli",
}


def _module_names(part: str) -> dict[str, pathlib.Path]:
    names = {}
    for path in (ROOT / part).rglob("*.py"):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        parts = path.relative_to(ROOT / part).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join((PART_PACKAGES[part], *parts))] = path
    return names


def _module_imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """Every module of `known` that `path` imports, wherever the import statement is: at the top,
    inside a function, or under `if TYPE_CHECKING:` (a late import that avoids a circle at load
    time is still a circle). ``from pkg import name`` counts as importing pkg.name when that is a
    module, else pkg."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in known else node.module)
    return {name for name in found if name in known}


def _graph(part: str) -> dict[str, set[str]]:
    modules = _module_names(part)
    known = set(modules)
    return {name: _module_imports(path, known) - {name} for name, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


@pytest.mark.parametrize("part", sorted(PART_PACKAGES))
def test_no_import_circles(part):
    graph = _graph(part)
    # The package __init__ re-exports the public surface; a module importing it back would make
    # every module part of one circle, so engine and client modules import each other directly.
    package = PART_PACKAGES[part]
    back_to_package = sorted(name for name, deps in graph.items() if package in deps)
    assert not back_to_package, f"import {package}'s modules directly, not the package: " + str(
        back_to_package
    )
    circles = _circles(graph)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 or (len(parts) == 3 and parts[2] in ENGINE_ROOMS) else None


def _back_edges(part: str, rooms: dict[str, set[str]], room_of) -> list[str]:
    """Asserts every module of `part` has a room, and returns the imports that reach a room not
    below the importer's (the part's __init__, its public surface, may import every room)."""
    graph = _graph(part)
    found = {room_of(name) for name in graph} - {None}
    assert found == set(rooms), f"every {part} sub-package needs a place in its rooms' table"
    homeless = sorted(n for n in graph if room_of(n) is None and n != PART_PACKAGES[part])
    assert not homeless, f"{part} modules outside every room (move them into one): {homeless}"
    bad = []
    for name, deps in sorted(graph.items()):
        room = room_of(name)
        if room is None:
            continue
        for dep in sorted(deps):
            target = room_of(dep)
            if target != room and target not in rooms[room]:
                bad.append(f"{name} -> {dep}")
    return bad


def test_engine_rooms_import_only_the_rooms_below_them():
    bad = _back_edges("engine", ENGINE_ROOMS, _room)
    assert not bad, "back-edges between the engine's rooms:\n" + "\n".join(bad)


def _checkpoint_room(module: str) -> str | None:
    """The longest room name of CHECKPOINT_ROOMS that `module` (qmill.checkpoints.ROOM.name or
    its sub-package's __init__) lives in."""
    inside = module.removeprefix("qmill.checkpoints.").split(".")
    if module == "qmill.checkpoints":
        return None
    for n in range(len(inside), 0, -1):
        room = ".".join(inside[:n])
        if room in CHECKPOINT_ROOMS and (n < len(inside) or _is_package(module)):
            return room
    return None


def _is_package(module: str) -> bool:
    parts = module.split(".")[2:]
    return (ROOT / "checkpoints" / pathlib.Path(*parts) / "__init__.py").is_file()


def test_checkpoint_rooms_import_only_the_rooms_below_them():
    bad = _back_edges("checkpoints", CHECKPOINT_ROOMS, _checkpoint_room)
    assert not bad, "back-edges between the checkpoint rooms:\n" + "\n".join(bad)


def test_checkpoint_room_of_a_module():
    # The table above is only as good as the room finder: a format room's module, formats/' own
    # modules, a room's __init__ and the part's public surface.
    assert _checkpoint_room("qmill.checkpoints.formats.safetensors.source") == "formats.safetensors"
    assert _checkpoint_room("qmill.checkpoints.formats.registry") == "formats"
    assert _checkpoint_room("qmill.checkpoints.formats.orbax") == "formats.orbax"
    assert _checkpoint_room("qmill.checkpoints.run.pipeline") == "run"
    assert _checkpoint_room("qmill.checkpoints") is None


def test_circle_finder_finds_a_late_import_circle():
    # The checks above would pass vacuously if the finder missed circles; a ring through a
    # function-level import and a TYPE_CHECKING import must be found.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_module_imports_count_late_and_type_checking_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from qmill.client import client\n"
        "def f():\n    from qmill.client.jobs import Jobs\n"
    )
    known = {"qmill.client", "qmill.client.client", "qmill.client.jobs"}
    assert _module_imports(source, known) == {"qmill.client.client", "qmill.client.jobs"}
