"""The job store: idempotency keys per tenant, listing, updates, counts, reopening the file."""

from __future__ import annotations

from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server.jobs import store as store_lib


def _create(store, tenant="a", request_id="", source="/s", destination="/d"):
    return store.create(
        tenant=tenant,
        request_id=request_id,
        source=source,
        destination=destination,
        recipe={"rules": [{"qtype": "int8"}]},
        output_format="npz",
        overwrite=False,
    )


def test_request_id_is_per_tenant_and_empty_ids_are_not_keys(tmp_path):
    store = store_lib.JobStore(tmp_path / "jobs.sqlite3")
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
    store = store_lib.JobStore(path)
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
    reopened = store_lib.JobStore(path)
    job = reopened.get(a.job_id)
    assert job is not None and job.recipe == {"rules": [{"qtype": "int8"}]}
    assert job.to_proto().tensors_done == 3
    assert reopened.get("missing") is None
