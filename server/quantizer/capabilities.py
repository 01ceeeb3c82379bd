"""What this server can do, for GetCapabilities."""

from __future__ import annotations

from importlib import metadata

import jax

from qmill.engine.core import calibration, qtypes
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server import config as config_lib
from qmill.server import registry
from qmill.server.odml import availability as odml_availability


def capabilities(config: config_lib.ServerConfig) -> pb.GetCapabilitiesResponse:
    device = jax.devices()[0]
    odml_available, odml_reason = odml_availability.availability()
    return pb.GetCapabilitiesResponse(
        qmill_version=metadata.version("qmill"),
        jax_version=jax.__version__,
        device_kind=device.platform,
        device_description=getattr(device, "device_kind", device.platform),
        qtypes=list(qtypes.names()),
        calibration_methods=list(calibration.METHODS),
        wire_dtypes=list(wire.wire_dtypes()),
        max_message_bytes=config.max_message_bytes,
        max_tensor_bytes=config.max_tensor_bytes,
        max_chunk_bytes=wire.MAX_CHUNK_BYTES,
        odml_available=odml_available,
        odml_unavailable_reason=odml_reason,
        models=registry.model_infos(),
        max_upload_bytes=config.max_upload_bytes,
    )
