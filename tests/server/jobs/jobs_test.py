"""The job store (idempotency keys per tenant, listing, updates, counts, reopening the file) and
the confinement of job paths to a tenant's directory, at submit and again in the runner."""

from __future__ import annotations

import os
import shutil
import time

import grpc
import pytest

from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server import auth, errors
from qmill.server import config as config_lib
from qmill.server.jobs import paths as paths_lib
from qmill.server.jobs import runner as runner_lib
from qmill.server.jobs import sqlite_store
from qmill.server.jobs import store as store_lib
from tests.server.jobs import records


def _create(store, tenant="a", request_id="", source="/s", destination="/d"):
    return records.create(
        store, tenant=tenant, request_id=request_id, source=source, destination=destination
    )


def test_request_id_is_per_tenant_and_empty_ids_are_not_keys(tmp_path):
    store = sqlite_store.SqliteJobStore(tmp_path / "jobs.sqlite3")
    first, created = _create(store, request_id="r")
    assert created and first.state == pb.JOB_STATE_QUEUED
    again, created = _create(store, request_id="r")
    assert not created and again.job_id == first.job_id
    other, created = _create(store, tenant="b", request_id="r")
    assert created and other.job_id != first.job_id
    one, _ = _create(store)
    two, _ = _create(store)
    assert one.job_id != two.job_id
    assert store.find("a", "r") == first and store.find("a", "") is None


def test_list_update_counts_and_reopen(tmp_path):
    path = tmp_path / "jobs.sqlite3"
    store = sqlite_store.SqliteJobStore(path)
    a, _ = _create(store, tenant="a")
    b, _ = _create(store, tenant="b")
    updated = store.update(a.job_id, state=pb.JOB_STATE_RUNNING, tensors_done=3, tensors_total=9)
    assert (updated.state, updated.tensors_done, updated.tensors_total) == (2, 3, 9)
    assert updated.updated >= a.updated
    assert [j.job_id for j in store.list(tenant="a")] == [a.job_id]
    assert {j.job_id for j in store.list(tenant=None)} == {a.job_id, b.job_id}
    assert [j.job_id for j in store.list(tenant=None, states=[pb.JOB_STATE_QUEUED])] == [b.job_id]
    assert store.counts() == {"running": 1, "queued": 1}
    store.close()
    reopened = sqlite_store.SqliteJobStore(path)
    job = reopened.get(a.job_id)
    assert job is not None and job.recipe == {"rules": [{"qtype": "int8"}]}
    assert job.to_proto().tensors_done == 3
    assert reopened.get("missing") is None


def test_a_language_model_request_and_its_report_are_kept_and_reopened(tmp_path):
    path = tmp_path / "jobs.sqlite3"
    store = sqlite_store.SqliteJobStore(path)
    request = pb.LanguageModelCalibration(method="gptq", gptq_block_size=64).SerializeToString()
    recipe = {"rules": [{"qtype": "int4"}]}
    job, _ = records.create(store, recipe=recipe, output_format="", language_model=request)
    store.update(job.job_id, calibration_report_json='{"perplexity": null}')
    store.close()
    reopened = sqlite_store.SqliteJobStore(path).get(job.job_id)
    assert reopened is not None and reopened.language_model == request
    assert reopened.to_proto().calibration_report_json == '{"perplexity": null}'
    plain, _ = _create(sqlite_store.SqliteJobStore(path))
    assert plain.language_model == b"" and plain.to_proto().calibration_report_json == ""


def test_a_jobs_file_from_before_language_models_gets_their_columns(tmp_path):
    import sqlite3

    path = tmp_path / "jobs.sqlite3"
    old_schema = sqlite_store._SCHEMA.replace(
        ",\n    language_model BLOB NOT NULL DEFAULT x'',\n"
        "    calibration_report_json TEXT NOT NULL DEFAULT ''",
        "",
    )
    assert "language_model" not in old_schema
    with sqlite3.connect(path) as db:
        db.executescript(old_schema)
        db.execute(
            "INSERT INTO jobs (job_id, tenant, request_id, source, destination, recipe_json, "
            "output_format, overwrite, state, created, updated) "
            "VALUES ('old', 'a', '', '/s', '/d', '{}', '', 0, 1, 0, 0)"
        )
    db.close()
    store = sqlite_store.SqliteJobStore(path)
    old = store.get("old")
    assert old is not None and old.language_model == b"" and old.calibration_report_json == ""
    new, _ = _create(store)
    assert store.get(new.job_id) == new


# --- Confinement of job paths (server/jobs/paths.py) -------------------------------------------


@pytest.fixture
def root(tmp_path):
    """A jobs root with two tenants' directories, team-a's holding a (fake) checkpoint."""
    for tenant in ("team-a", "team-b"):
        (tmp_path / "root" / tenant).mkdir(parents=True)
    (tmp_path / "root" / "team-a" / "ckpt").mkdir()
    (tmp_path / "root" / "team-a" / "ckpt" / "params.npz").write_bytes(b"x")
    return tmp_path / "root"


def _confined(root) -> paths_lib.PathPolicy:
    return paths_lib.PathPolicy(jobs_root=str(root), multi_tenant=True)


def test_relative_and_inside_absolute_paths_resolve_in_the_tenants_directory(root):
    policy = _confined(root)
    a = os.path.realpath(root / "team-a")
    assert policy.resolve("team-a", "ckpt", "source") == os.path.join(a, "ckpt")
    assert policy.resolve("team-a", "out/new.npz", "destination") == os.path.join(a, "out/new.npz")
    assert policy.resolve("team-a", "x/../ckpt", "source") == os.path.join(a, "ckpt")
    assert policy.resolve("team-a", str(root / "team-a" / "ckpt"), "source") == os.path.join(
        a, "ckpt"
    )


@pytest.mark.parametrize(
    "value",
    [
        "../team-a/ckpt",  # another tenant's files
        "..",
        ".",  # the directory itself: as a destination it would be replaced whole
        "ckpt/../../team-a/ckpt",
        "{root}/team-a/ckpt",  # absolute, another tenant's
        "/etc/passwd",  # absolute, outside the root: refused, never re-rooted
    ],
)
def test_paths_that_leave_the_tenants_directory_are_refused(root, value):
    with pytest.raises(ValueError, match=r"outside your jobs directory: .*team-b/") as raised:
        _confined(root).resolve("team-b", value.replace("{root}", str(root)), "source")
    assert errors.status_for(raised.value)[0] is grpc.StatusCode.INVALID_ARGUMENT


def test_a_symlink_out_of_the_tenants_directory_is_refused(root):
    (root / "team-b" / "link").symlink_to(root / "team-a" / "ckpt")
    (root / "team-b" / "outdir").symlink_to(root / "team-a")
    policy = _confined(root)
    with pytest.raises(ValueError, match=r"source 'link' is outside your jobs directory"):
        policy.resolve("team-b", "link", "source")
    with pytest.raises(ValueError, match=r"destination 'outdir/o\.npz' is outside"):
        policy.resolve("team-b", "outdir/o.npz", "destination")
    # A link that stays inside is fine: the job keeps the resolved path.
    (root / "team-a" / "alias").symlink_to(root / "team-a" / "ckpt")
    assert policy.resolve("team-a", "alias", "source") == os.path.realpath(root / "team-a/ckpt")


def test_check_job_looks_inside_the_source_and_at_the_partial_output(root):
    policy = _confined(root)
    (root / "team-b" / "secret").write_text("b's")
    assert policy.check_job("team-a", "ckpt", "o.npz")[0].endswith("team-a/ckpt")
    (root / "team-a" / "ckpt" / "d").symlink_to(root / "team-b" / "secret")
    with pytest.raises(ValueError, match=r"source file d .* is outside"):
        policy.check_job("team-a", "ckpt", "o.npz")
    (root / "team-a" / "ckpt" / "d").unlink()
    (root / "team-a" / "o.npz.qmill-partial").symlink_to(root / "team-b")
    with pytest.raises(ValueError, match=r"partial output .* is outside"):
        policy.check_job("team-a", "ckpt", "o.npz")


@pytest.mark.parametrize("tenant", ["..", ".", "", "a/b"])
def test_a_tenant_name_that_is_not_one_directory_is_a_failed_precondition(root, tenant):
    with pytest.raises(errors.FailedPrecondition, match="cannot name a directory") as raised:
        _confined(root).resolve(tenant, "ckpt", "source")
    assert raised.value.code == "FAILED_PRECONDITION"


def test_without_a_jobs_root_auth_refuses_and_single_user_allows_any_path(tmp_path):
    with pytest.raises(errors.FailedPrecondition, match="must start it with --jobs-root") as raised:
        paths_lib.PathPolicy(multi_tenant=True).resolve("team-a", "/data/ckpt", "source")
    assert raised.value.code == "FAILED_PRECONDITION"
    single = paths_lib.PathPolicy(multi_tenant=False)
    assert single.resolve("default", "/etc/x", "source") == "/etc/x"
    assert single.resolve("default", "rel", "source") == os.path.abspath("rel")
    assert "single-user" in single.describe()


@pytest.mark.parametrize("policy", [paths_lib.PathPolicy(), paths_lib.PathPolicy(jobs_root="/r")])
def test_object_store_urls_and_empty_paths_say_what_to_do(policy):
    with pytest.raises(ValueError, match=r"object-store URLs \(gs://, s3://, ...\) are not supp"):
        policy.resolve("a", "gs://bucket/ckpt", "source")
    with pytest.raises(ValueError, match="destination is empty"):
        policy.resolve("a", "", "destination")


def test_policy_from_config(tmp_path):
    tokens = auth.TokenTable.from_mapping({"t": {"tenant": "a"}})
    policy = paths_lib.PathPolicy.from_config(
        config_lib.ServerConfig(jobs_root=str(tmp_path), tokens=tokens)
    )
    assert policy == paths_lib.PathPolicy(jobs_root=str(tmp_path), multi_tenant=True)
    assert str(tmp_path) in policy.describe()
    assert not paths_lib.PathPolicy.from_config(
        config_lib.ServerConfig(jobs_root=None)
    ).multi_tenant
    with pytest.raises(ValueError, match=r"--jobs-root .* is not a directory"):
        paths_lib.PathPolicy.from_config(config_lib.ServerConfig(jobs_root=str(tmp_path / "no")))


@pytest.mark.parametrize("swap", ["source", "destination"])
def test_the_runner_checks_again_a_symlink_made_after_the_submit(root, tmp_path, swap):
    """The job passed SubmitJob's check; then its source (or destination's directory) became a
    link to team-b's files. The runner refuses it before reading or writing anything."""
    (root / "team-a" / "outdir").mkdir()
    (root / "team-b" / "ckpt").mkdir()
    store = sqlite_store.SqliteJobStore(tmp_path / "jobs.sqlite3")
    record, _ = _create(
        store,
        tenant="team-a",
        source=str(root / "team-a" / "ckpt"),
        destination=str(root / "team-a" / "outdir" / "o.npz"),
    )
    moved = root / "team-a" / ("ckpt" if swap == "source" else "outdir")
    shutil.rmtree(moved)
    moved.symlink_to(root / "team-b" / ("ckpt" if swap == "source" else ""))
    runner = runner_lib.JobRunner(store, paths=_confined(root))
    runner.start()
    try:
        deadline = time.monotonic() + 30
        while (job := store.get(record.job_id)).state not in store_lib.FINAL:
            assert time.monotonic() < deadline, job
            time.sleep(0.02)
    finally:
        runner.stop()
    assert job.state == pb.JOB_STATE_FAILED
    assert f"{swap} " in job.error and "outside your jobs directory" in job.error
    assert not list((root / "team-b").glob("o.npz*"))
