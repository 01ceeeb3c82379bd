"""A job record made in a store, the fields a test does not care about filled in."""

from __future__ import annotations

from typing import Any

INT8 = {"rules": [{"qtype": "int8"}]}
DEFAULTS = {
    "tenant": "a",
    "request_id": "",
    "source": "/s",
    "destination": "/d",
    "recipe": INT8,
    "output_format": "npz",
    "overwrite": False,
}


def create(store: Any, **fields: Any) -> Any:
    """store.create(...) with DEFAULTS for what `fields` leaves out: (record, created)."""
    return store.create(**{**DEFAULTS, **fields})
