"""Object-store job paths: URL parsing and confinement (urls.py, paths.py), the copies to and
from S3 (object_store.py, against moto's S3 server on loopback), the --jobs-url-root option,
and a URL job stopped by a server shutdown and resumed by the next runner (scratch.py)."""

from __future__ import annotations

import pathlib
import time

import pytest
from etils import epath
from etils.epath import backend

from qmill.cli import main as cli
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server import app, errors
from qmill.server import config as config_lib
from qmill.server.jobs import object_store, scratch, sqlite_store, urls
from qmill.server.jobs import paths as paths_lib
from qmill.server.jobs import runner as runner_lib
from qmill.server.jobs import store as store_lib
from tests import buckets
from tests.checkpoints import slow_reads
from tests.server.jobs import records

ROOT = pathlib.Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "tiny-mlp"
INT8 = {"rules": [{"qtype": "int8"}]}


def _no_check() -> None:
    pass


def _listing(url: str) -> list[str]:
    fs = backend.fsspec_backend.fs(url)
    prefix = url.removeprefix("s3://")
    return sorted(p.removeprefix(prefix) for p in fs.find(prefix))


# --- URLs and confinement (no I/O) ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("http://b/k", "scheme 'http://' is not supported"),
        ("file:///etc/passwd", "scheme 'file://' is not supported"),
        ("s3://", "needs a bucket"),
        ("s3://b/a/../c", r"no '\.\.'"),
        ("s3://b/a/./c", r"no '\.\.', '\.'"),
        ("s3://b/a//c", "empty"),
        ("s3://b/a?versionId=1", "may not contain"),
        ("gs://b/a*", "may not contain"),
    ],
)
def test_urls_that_could_name_another_object_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        urls.parse(value, "source")


def test_url_parsing_and_prefixes():
    url = urls.parse("s3://bucket/jobs/team-a/ckpt/", "source")
    assert (
        url == urls.Url("s3", "bucket", "jobs/team-a/ckpt")
        and str(url) == "s3://bucket/jobs/team-a/ckpt"
    )
    prefix = urls.parse("s3://bucket/jobs/team-a", "root")
    assert url.is_below(prefix)
    assert not prefix.is_below(prefix)  # the prefix itself is no job path
    assert not urls.parse("s3://bucket/jobs/team-ab/x", "s").is_below(prefix)
    assert not urls.parse("gs://bucket/jobs/team-a/x", "s").is_below(prefix)
    assert urls.parse("s3://bucket/x", "s").is_below(urls.parse("s3://bucket", "root"))
    assert config_lib.split_url_roots("s3://a/x, gs://b", "", "s3://c") == (
        "s3://a/x",
        "gs://b",
        "s3://c",
    )


@pytest.mark.parametrize("multi_tenant", [True, False])
def test_a_tenants_urls_are_below_root_slash_tenant(multi_tenant):
    """Tokens or not (the single-user tenant is "default", as under --jobs-root), and with or
    without a --jobs-root for local paths."""
    tenant = "team-a" if multi_tenant else "default"
    policy = paths_lib.PathPolicy(multi_tenant=multi_tenant, url_roots=("s3://b/jobs", "gs://g"))
    assert policy.resolve(tenant, f"s3://b/jobs/{tenant}/ck/", "source") == (
        f"s3://b/jobs/{tenant}/ck"
    )
    assert policy.resolve(tenant, f"gs://g/{tenant}/o.npz", "destination") == (
        f"gs://g/{tenant}/o.npz"
    )
    for outside in ("s3://b/jobs/ck", "s3://b/jobs/other/ck", f"s3://b2/jobs/{tenant}/ck"):
        with pytest.raises(ValueError, match="outside your object-store jobs prefix") as raised:
            policy.resolve(tenant, outside, "source")
        assert f"s3://b/jobs/{tenant}/ or gs://g/{tenant}/" in str(raised.value)
    assert "job URLs confined to s3://b/jobs/<tenant>/, gs://g/<tenant>/" in policy.describe()
    # check_job takes URLs too (no symlinks to look for in a bucket).
    assert policy.check_job(tenant, f"gs://g/{tenant}/a", f"gs://g/{tenant}/b") == (
        f"gs://g/{tenant}/a",
        f"gs://g/{tenant}/b",
    )


def test_url_roots_from_config_are_checked(tmp_path):
    policy = paths_lib.PathPolicy.from_config(
        config_lib.ServerConfig(jobs_url_roots=("s3://b/jobs/",))
    )
    assert policy.url_roots == ("s3://b/jobs",)
    with pytest.raises(ValueError, match="--jobs-url-root 'http://b'"):
        paths_lib.PathPolicy.from_config(config_lib.ServerConfig(jobs_url_roots=("http://b",)))
    with pytest.raises(ValueError, match="--jobs-url-root"):
        paths_lib.PathPolicy().resolve("default", "s3://b/jobs/default/x", "source")


def test_serve_takes_url_roots_from_flags_or_the_environment(monkeypatch):
    seen = []

    async def serve(config, **_):  # job_peer_backends, from the composition root
        seen.append(config.jobs_url_roots)

    monkeypatch.setattr(app, "serve", serve)
    monkeypatch.setenv("QMILL_JOBS_URL_ROOT", "s3://env/a,gs://env/b")
    assert (
        cli.main(["serve", "--jobs-url-root", "s3://a/x,gs://b", "--jobs-url-root", "s3://c"]) == 0
    )
    assert cli.main(["serve"]) == 0
    assert seen == [("s3://a/x", "gs://b", "s3://c"), ("s3://env/a", "gs://env/b")]


def test_a_missing_filesystem_is_failed_precondition(monkeypatch):
    object_store.require_filesystem("s3://b/k")  # installed with the dev extra
    monkeypatch.setitem(object_store._FILESYSTEMS, "gs", "gcsfs_absent")
    with pytest.raises(errors.FailedPrecondition, match=r"qmill\[objectstore\]") as raised:
        object_store.require_filesystem("gs://b/k")
    assert raised.value.code == "FAILED_PRECONDITION"


# --- Copies to and from S3 (moto) ----------------------------------------------------------------


def test_download_and_upload_round_trip_a_tree_and_a_file(s3, tmp_path):
    bucket = s3()
    object_store.upload(
        EXAMPLE, f"s3://{bucket}/t/ckpt", tag="j1", overwrite=False, check=_no_check
    )
    expected = sorted(
        "/" + p.relative_to(EXAMPLE).as_posix() for p in EXAMPLE.rglob("*") if p.is_file()
    )
    assert _listing(f"s3://{bucket}/t/ckpt") == expected
    assert _listing(f"s3://{bucket}/t") == ["/ckpt" + name for name in expected]  # no temporary
    object_store.download(f"s3://{bucket}/t/ckpt", tmp_path / "back", check=_no_check)
    for name in expected:
        assert (tmp_path / "back" / name[1:]).read_bytes() == (EXAMPLE / name[1:]).read_bytes()
    one = tmp_path / "one.bin"
    one.write_bytes(b"x" * 1000)
    object_store.upload(one, f"s3://{bucket}/t/one.bin", tag="j2", overwrite=False, check=_no_check)
    with pytest.raises(FileExistsError):
        object_store.upload(
            one, f"s3://{bucket}/t/one.bin", tag="j3", overwrite=False, check=_no_check
        )
    object_store.download(f"s3://{bucket}/t/one.bin", tmp_path / "one-back.bin", check=_no_check)
    assert (tmp_path / "one-back.bin").read_bytes() == b"x" * 1000
    assert object_store.exists(f"s3://{bucket}/t/ckpt") and not object_store.exists(
        f"s3://{bucket}/u"
    )


def test_an_overwritten_directory_is_replaced_whole(s3, tmp_path):
    bucket = s3()
    old, new = tmp_path / "old", tmp_path / "new"
    (old / "sub").mkdir(parents=True)
    (old / "sub" / "stale").write_bytes(b"old")
    (old / "keep").write_bytes(b"old")
    new.mkdir()
    (new / "keep").write_bytes(b"new")
    url = f"s3://{bucket}/d"
    object_store.upload(old, url, tag="a", overwrite=False, check=_no_check)
    object_store.upload(new, url, tag="b", overwrite=True, check=_no_check)
    assert _listing(url) == ["/keep"]
    assert epath.Path(f"{url}/keep").read_bytes() == b"new"


def test_a_directory_copy_that_fails_half_way_is_removed(s3, tmp_path, monkeypatch):
    """The final step (one server-side copy per file) dies on the third file: the files it had
    copied are deleted, and the temporary prefix too."""
    bucket = s3()
    url = f"s3://{bucket}/half/ckpt"
    fs = backend.fsspec_backend.fs(url)
    copy, calls = fs.cp_file, []

    def flaky(src, dst, **kwargs):
        calls.append(dst)
        if len(calls) == 3:
            raise OSError("store unavailable (test)")
        return copy(src, dst, **kwargs)

    monkeypatch.setattr(fs, "cp_file", flaky)
    with pytest.raises(OSError, match="store unavailable"):
        object_store.upload(EXAMPLE, url, tag="j", overwrite=False, check=_no_check)
    assert len(calls) == 3
    assert _listing(f"s3://{bucket}/half") == []


def test_a_cancel_during_the_upload_writes_nothing_at_the_destination(s3, tmp_path):
    bucket = s3()
    checks = []

    def cancel_after_a_few() -> None:
        checks.append(1)
        if len(checks) == 4:
            raise RuntimeError("cancelled (test)")

    with pytest.raises(RuntimeError, match="cancelled"):
        object_store.upload(
            EXAMPLE, f"s3://{bucket}/c/ckpt", tag="j", overwrite=False, check=cancel_after_a_few
        )
    assert _listing(f"s3://{bucket}/c") == []


# --- A URL job stopped by a shutdown resumes with the same bytes ---------------------------------


def _wait(store, job_id, done, seconds=45.0):
    deadline = time.monotonic() + seconds
    while not done(job := store.get(job_id)):
        assert time.monotonic() < deadline, job
        time.sleep(0.02)
    return job


def test_a_url_job_resumes_after_a_shutdown_with_the_same_bytes(s3, tmp_path, monkeypatch):
    bucket = s3()
    base = f"s3://{bucket}/jobs/default"
    buckets.put_tree(EXAMPLE, f"{base}/tiny-mlp")
    reference = tmp_path / "ref.npz"
    assert cli.main(["quantize", str(EXAMPLE), "-o", str(reference), "-q", "--format", "npz"]) == 0
    store = sqlite_store.SqliteJobStore(tmp_path / "jobs.sqlite3")
    record, _ = records.create(
        store,
        tenant="default",
        source=f"{base}/tiny-mlp",
        destination=f"{base}/out.npz",
        recipe=INT8,
    )
    policy = paths_lib.PathPolicy(url_roots=(f"s3://{bucket}/jobs",))
    work = scratch.Scratch(tmp_path / "job-staging")
    downloads = []
    download = object_store.download
    monkeypatch.setattr(
        object_store, "download", lambda *a, **k: downloads.append(a[0]) or download(*a, **k)
    )

    slow_reads.delay_reads(monkeypatch, 0.3)
    first = runner_lib.JobRunner(store, paths=policy, scratch=work)
    first.start()
    _wait(store, record.job_id, lambda j: j.tensors_done >= 2)
    first.stop()
    assert store.get(record.job_id).state == pb.JOB_STATE_RUNNING
    job_dir = work.root / record.job_id
    assert (job_dir / "source" / "tiny-mlp").is_dir()
    assert (job_dir / "output" / "out.npz.qmill-partial").is_dir()
    assert not object_store.exists(f"{base}/out.npz")

    slow_reads.delay_reads(monkeypatch, 0)
    second = runner_lib.JobRunner(store, paths=policy, scratch=work)
    second.start()
    try:
        job = _wait(store, record.job_id, lambda j: j.state in store_lib.FINAL)
    finally:
        second.stop()
    # The downloaded source was reused: a new copy (new mtimes) would not match the partial
    # output's fingerprint, and the job would fail.
    assert job.state == pb.JOB_STATE_SUCCEEDED, job.error
    assert downloads == [f"{base}/tiny-mlp"]
    assert epath.Path(f"{base}/out.npz").read_bytes() == reference.read_bytes()
    assert not job_dir.exists()


def test_sweep_deletes_scratch_of_jobs_that_are_not_active(tmp_path):
    work = scratch.Scratch(tmp_path / "job-staging")
    for job_id in ("running", "gone"):
        (work.root / job_id / "output").mkdir(parents=True)
    work.sweep(keep=["running", "queued"])
    assert [p.name for p in work.root.iterdir()] == ["running"]
