"""Object-store buckets for the jobs tests (the `s3` fixture's moto server): local trees copied
in, and the bucket whose jobs root holds the example checkpoint for two tenants."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "tiny-mlp"


def put_tree(local: pathlib.Path, url: str) -> None:
    """Every file under `local` to the same relative path under `url`."""
    from etils import epath

    for file in sorted(p for p in local.rglob("*") if p.is_file()):
        epath.Path(f"{url}/{file.relative_to(local).as_posix()}").write_bytes(file.read_bytes())


def with_example(new_bucket: Callable[[], str]) -> str:
    """A new bucket (the `s3` fixture's function) whose jobs root `s3://B/jobs` holds the example
    in each tenant's prefix (team-a, team-b); its name."""
    name = new_bucket()
    for tenant in ("team-a", "team-b"):
        put_tree(EXAMPLE, f"s3://{name}/jobs/{tenant}/tiny-mlp")
    return name
