"""Admin-only operations, served without a .proto of their own (well-known types on the wire).

`qmill.v1.Admin/GetServerInfo(google.protobuf.Empty) -> google.protobuf.Struct`: live load and
limits of this server (in-flight bytes overall and per tenant, open streams), for operators.
Server-wide information, hence admin-only: a user token gets PERMISSION_DENIED.

Until the contract grows an Admin service (see the report in issue 5), clients call it with a
generic stub: channel.unary_unary("/qmill.v1.Admin/GetServerInfo", ...).
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import empty_pb2, struct_pb2

from qmill.server import auth, errors, limits
from qmill.server import config as config_lib

SERVICE = "qmill.v1.Admin"
GET_SERVER_INFO = f"/{SERVICE}/GetServerInfo"


class AdminServicer:
    def __init__(
        self,
        config: config_lib.ServerConfig,
        limiter: limits.ByteLimiter,
        streams: limits.StreamLimitInterceptor,
    ) -> None:
        self._config = config
        self._limiter = limiter
        self._streams = streams

    @errors.unary
    async def GetServerInfo(self, request: empty_pb2.Empty, context: Any) -> struct_pb2.Struct:
        auth.require_admin("GetServerInfo")
        info = struct_pb2.Struct()
        info.update(
            {
                "inflight_bytes": self._limiter.used,
                "inflight_peak_bytes": self._limiter.peak,
                "inflight_bytes_by_tenant": dict(self._limiter.by_tenant),
                "active_streams": self._streams.active,
                "max_concurrent_streams": self._config.max_concurrent_streams,
                "max_inflight_bytes": self._config.max_inflight_bytes,
                "max_tenant_inflight_bytes": self._config.max_tenant_inflight_bytes,
                "max_tensor_bytes": self._config.max_tensor_bytes,
                "max_upload_bytes": self._config.max_upload_bytes,
            }
        )
        return info


def add_to_server(servicer: AdminServicer, server: grpc.aio.Server) -> None:
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "GetServerInfo": grpc.unary_unary_rpc_method_handler(
                servicer.GetServerInfo,
                request_deserializer=empty_pb2.Empty.FromString,
                response_serializer=struct_pb2.Struct.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((handler,))
