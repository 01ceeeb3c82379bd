"""Batch jobs on s3:// URLs through a real server and a real S3 endpoint (moto on loopback):
the same bytes as `qmill quantize`, tenants confined to their prefix, no object at the
destination after a failed upload, and no scratch left once a job ends."""

from __future__ import annotations

import pathlib
import re

import pytest
from etils import epath

from qmill.cli import main as cli
from qmill.client import Client, credentials, errors
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server import auth
from qmill.server.jobs import object_store
from tests import buckets

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-mlp"  # Orbax, 5 float tensors + 1 int32
TOKENS = {
    "token-a": {"tenant": "team-a", "role": "user"},
    "token-b": {"tenant": "team-b", "role": "user"},
}
INT8 = {"rules": [{"qtype": "int8"}]}


def _client(address: str, token: str | None = None) -> Client:
    creds = credentials.Credentials.from_files(token=token) if token else None
    return Client(address, timeout=30, credentials=creds)


def _finished(client: Client, job_id: str) -> pb.Job:
    return list(client.jobs.watch(job_id))[-1].job


def _scratch(server) -> pathlib.Path:
    return pathlib.Path(server.server.config.data_dir) / "job-staging"


@pytest.fixture(scope="module")
def bucket(s3) -> str:
    """A bucket whose jobs root `s3://B/jobs` holds the example in each tenant's prefix."""
    return buckets.with_example(s3)


@pytest.fixture(scope="module")
def url_server(make_server, tmp_path_factory, bucket):
    db = tmp_path_factory.mktemp("jobs") / "jobs.sqlite3"
    return make_server(
        tokens=auth.TokenTable.from_mapping(TOKENS),
        jobs_db=str(db),
        jobs_url_roots=(f"s3://{bucket}/jobs",),
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> bytes:
    """What `qmill quantize` writes for the example with INT8, as npz."""
    out = tmp_path_factory.mktemp("cli") / "ref.npz"
    assert cli.main(["quantize", str(EXAMPLE), "-o", str(out), "-q", "--format", "npz"]) == 0
    return out.read_bytes()


def test_url_to_url_job_equals_qmill_quantize(url_server, bucket, reference):
    base = f"s3://{bucket}/jobs/team-a"
    with _client(url_server.address, "token-a") as client:
        job = client.jobs.submit(
            f"{base}/tiny-mlp", f"{base}/out/int8.npz", INT8, output_format="npz"
        )
        done = _finished(client, job.job_id)
        assert done.state == pb.JOB_STATE_SUCCEEDED, done.error
        assert (done.tensors_done, done.tensors_total) == (6, 6)
        assert done.source == f"{base}/tiny-mlp" and done.destination == f"{base}/out/int8.npz"
        # Submitting to it again without overwrite: it exists now.
        with pytest.raises(errors.QmillError, match="ALREADY_EXISTS"):
            client.jobs.submit(f"{base}/tiny-mlp", f"{base}/out/int8.npz", INT8)
    assert epath.Path(f"{base}/out/int8.npz").read_bytes() == reference
    # Only the output is left in the prefix (no temporary upload object) and no scratch.
    assert [p.name for p in epath.Path(f"{base}/out").iterdir()] == ["int8.npz"]
    assert not _scratch(url_server).exists() or not list(_scratch(url_server).iterdir())


def test_orbax_directory_to_url_and_url_to_local_directory(url_server, bucket, tmp_path):
    """A directory output (Orbax) is uploaded whole; a URL source can write a local path only
    where local paths are allowed (this server has no --jobs-root: refused)."""
    base = f"s3://{bucket}/jobs/team-b"
    with _client(url_server.address, "token-b") as client:
        job = client.jobs.submit(f"{base}/tiny-mlp", f"{base}/tiny-mlp-int8", INT8)
        done = _finished(client, job.job_id)
        assert done.state == pb.JOB_STATE_SUCCEEDED, done.error
        with pytest.raises(errors.QmillError, match=r"FAILED_PRECONDITION.*--jobs-root"):
            client.jobs.submit(f"{base}/tiny-mlp", str(tmp_path / "o.npz"), INT8)
    local = tmp_path / "tiny-mlp-int8"
    object_store.download(f"{base}/tiny-mlp-int8", local, check=lambda: None)
    out = tmp_path / "cli" / "tiny-mlp-int8"
    out.parent.mkdir()  # the CLI refuses an output folder that does not exist
    assert cli.main(["quantize", str(EXAMPLE), "-o", str(out), "-q"]) == 0
    # Orbax's own files carry timestamps; the tensors must be the CLI's.
    assert _tensors(local) == _tensors(out)
    assert {p.name for p in local.iterdir()} == {p.name for p in out.iterdir()}


def _tensors(path: pathlib.Path) -> dict[str, bytes]:
    from qmill import checkpoints

    with checkpoints.open_source(path) as source:
        return {e.path: source.read(e.path).tobytes() for e in source.entries()}


@pytest.mark.parametrize(
    ("source", "dest", "message"),
    [
        ("{b}/jobs/team-b/tiny-mlp", "{b}/jobs/team-a/o.npz", "outside your object-store"),
        ("{b}/jobs/team-a/tiny-mlp", "{b}/jobs/team-b/o.npz", "outside your object-store"),
        ("{b}/jobs/team-a/../team-b/tiny-mlp", "{b}/jobs/team-a/o.npz", r"no '\.\.'"),
        ("{b}/other/tiny-mlp", "{b}/jobs/team-a/o.npz", "outside your object-store"),
        ("{b}/jobs/team-a", "{b}/jobs/team-a/o.npz", "outside your object-store"),
        ("{b}/jobs/team-a/tiny-mlp", "{b}/jobs/team-a/o*.npz", "may not contain"),
        ("gs://x/jobs/team-a/tiny-mlp", "{b}/jobs/team-a/o.npz", "outside your object-store"),
        ("http://x/jobs/team-a/t", "{b}/jobs/team-a/o.npz", "scheme 'http://' is not supp"),
    ],
)
def test_urls_outside_the_tenants_prefix_are_refused(url_server, bucket, source, dest, message):
    b = f"s3://{bucket}"
    with (
        _client(url_server.address, "token-a") as client,
        pytest.raises(errors.QmillError) as raised,
    ):
        client.jobs.submit(source.format(b=b), dest.format(b=b), INT8)
    assert raised.value.code == "INVALID_ARGUMENT"
    assert re.search(message, raised.value.details), raised.value.details
    assert not epath.Path(f"{b}/jobs/team-b/o.npz").exists()


def test_a_missing_source_url_is_refused(url_server, bucket):
    base = f"s3://{bucket}/jobs/team-a"
    with (
        _client(url_server.address, "token-a") as client,
        pytest.raises(errors.QmillError, match=r"INVALID_ARGUMENT.*nothing-here does not"),
    ):
        client.jobs.submit(f"{base}/nothing-here", f"{base}/o.npz", INT8)


def test_without_a_url_root_urls_are_refused(make_server, tmp_path, bucket):
    """Single-user mode, no --jobs-url-root: local paths work, URLs are refused."""
    server = make_server(jobs_db=str(tmp_path / "jobs.sqlite3"))
    with _client(server.address) as client:
        with pytest.raises(errors.QmillError) as raised:
            client.jobs.submit(
                f"s3://{bucket}/jobs/default/tiny-mlp", str(tmp_path / "o.npz"), INT8
            )
        assert client.jobs.list() == []
    assert raised.value.code == "INVALID_ARGUMENT"
    assert "--jobs-url-root" in raised.value.details


def test_single_user_urls_are_under_root_default(make_server, tmp_path, bucket, reference):
    """Without tokens the one tenant is "default", as with --jobs-root: URL/default/..."""
    root = f"s3://{bucket}/single"
    buckets.put_tree(EXAMPLE, f"{root}/default/tiny-mlp")
    server = make_server(jobs_db=str(tmp_path / "jobs.sqlite3"), jobs_url_roots=(root,))
    with _client(server.address) as client:
        with pytest.raises(errors.QmillError, match="outside your object-store"):
            client.jobs.submit(f"{root}/tiny-mlp", f"{root}/o.npz", INT8)
        # A local destination from a URL source (single-user: any local path).
        job = client.jobs.submit(f"{root}/default/tiny-mlp", str(tmp_path / "o.npz"), INT8)
        assert _finished(client, job.job_id).state == pb.JOB_STATE_SUCCEEDED
    assert (tmp_path / "o.npz").read_bytes() == reference
    assert not list(_scratch(server).iterdir())


def test_a_failed_upload_leaves_nothing_at_the_destination(url_server, bucket, monkeypatch):
    """The upload dies half way through writing the object (a connection reset). fsspec
    still commits what was written when its file closes, so the half object exists for a
    moment, but under the temporary name: the destination name never holds it, and the
    temporary object and the scratch are deleted with the failed job."""
    copy = object_store._copy

    def cut(src, dst, check):
        if not isinstance(dst, epath.Path) or "://" not in str(dst):
            return copy(src, dst, check)
        data = pathlib.Path(src).read_bytes()
        with dst.open("wb") as writer:
            writer.write(data[: len(data) // 2])
            raise ConnectionResetError("connection reset by peer (test)")

    monkeypatch.setattr(object_store, "_copy", cut)
    base = f"s3://{bucket}/jobs/team-a"
    with _client(url_server.address, "token-a") as client:
        job = client.jobs.submit(f"{base}/tiny-mlp", f"{base}/cut/o.npz", INT8, output_format="npz")
        done = _finished(client, job.job_id)
    assert done.state == pb.JOB_STATE_FAILED
    assert "connection reset" in done.error
    assert not epath.Path(f"{base}/cut").exists()  # neither o.npz nor .o.npz.qmill-upload-*
    assert not (_scratch(url_server) / job.job_id).exists()


def test_a_missing_filesystem_package_names_the_extra(url_server, bucket, monkeypatch):
    monkeypatch.setitem(object_store._FILESYSTEMS, "s3", "s3fs_not_installed")
    base = f"s3://{bucket}/jobs/team-a"
    with (
        _client(url_server.address, "token-a") as client,
        pytest.raises(errors.QmillError) as raised,
    ):
        client.jobs.submit(f"{base}/tiny-mlp", f"{base}/o.npz", INT8)
    assert raised.value.code == "FAILED_PRECONDITION"
    assert "s3fs_not_installed" in raised.value.details
    assert "pip install 'qmill[objectstore]'" in raised.value.details
