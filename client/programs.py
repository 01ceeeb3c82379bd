"""Programs sent to a server: inside the request when small, else as an upload first.

The `qmill` commands that make and send them (`--artifact FILE` or `--model-fn M:F`) are
qmill.cli.programs'.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import safetensors.numpy

from qmill.client.service_client import ServiceClient

# Programs up to this size travel inside the request; larger ones as an upload (the server's
# message limit is 8 MiB by default, and an export program carries the model's weights).
INLINE_BYTES = 4 * 1024 * 1024


def upload_program(client: ServiceClient, data: bytes) -> str:
    """Uploads an artifact (a safetensors file of one uint8 tensor "program"); its upload id."""
    content = safetensors.numpy.save({"program": np.frombuffer(data, np.uint8)})
    return client.upload(content, name="program").upload_id


def program_fields(client: ServiceClient, data: bytes) -> dict[str, Any]:
    """{"program": bytes} for a small artifact, else {"program_upload_id": id} (uploaded)."""
    if len(data) <= INLINE_BYTES:
        return {"program": data}
    return {"program_upload_id": upload_program(client, data)}
