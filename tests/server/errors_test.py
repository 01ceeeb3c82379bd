"""A full or read-only disk under the server is a status saying so, never INTERNAL (issue 18,
item 7, server side); other OS errors stay bugs."""

from __future__ import annotations

import errno
import os

import grpc
import pytest

from qmill.server import errors


@pytest.mark.parametrize(
    ("number", "code", "what"),
    [
        (errno.ENOSPC, grpc.StatusCode.RESOURCE_EXHAUSTED, "full"),
        (errno.EDQUOT, grpc.StatusCode.RESOURCE_EXHAUSTED, "over its quota"),
        (errno.EROFS, grpc.StatusCode.UNAVAILABLE, "read-only"),
    ],
)
def test_a_disk_failure_says_so_without_the_servers_paths(number, code, what):
    exc = OSError(number, os.strerror(number), "/srv/qmill/calibrations/x.npz")
    assert errors.status_for(exc) == (
        code,
        f"the server's disk is {what}; its operator must fix it (retry later)",
    )


def test_other_os_errors_are_internal():
    exc = OSError(errno.EIO, os.strerror(errno.EIO), "/srv/qmill/x")
    assert errors.status_for(exc) == (grpc.StatusCode.INTERNAL, "internal error")
