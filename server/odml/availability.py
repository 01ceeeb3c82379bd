"""Whether this server can export LiteRT models, without importing the export route.

Apart from export.py so that GetCapabilities answers it without importing the route's engine
providers and Flax, which a server that only quantizes never needs (issue 27: its memory).
"""

from __future__ import annotations

import importlib.util

PACKAGES = ("litert_converter", "ai_edge_litert")
INSTALL_HINT = 'ExportOdml needs the qmill[odml] extra on the server: pip install "qmill[odml]"'


def availability() -> tuple[bool, str]:
    """(available, reason when not) without importing the (large) packages."""
    missing = [p for p in PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        return False, f"{INSTALL_HINT} (missing: {', '.join(missing)})"
    return True, ""
