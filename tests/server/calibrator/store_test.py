"""CalibrationStore: exact round trips, tenants, persistence across restarts, atomic writes."""

import numpy as np
import pytest

from qmill.server import errors, params
from qmill.server.calibrator import store as store_lib


def _cal(cid, tenant="a", **kw):
    stats = {
        "Dense_0": {
            "dot_general0_lhs": {
                "count": np.array(3, np.int32),
                # Values whose float32 bits a lossy format would change.
                "sum_of_absmax": np.array([0.1, 1 / 3, 7e-39], np.float32),
            }
        },
        "final_output0": {
            "count": np.array(3, np.int32),
            "sum_of_minmax": np.zeros((2,), np.float32),
        },
    }
    fields = dict(model_key='["cnn", {}]', rules_key="[]", batches=3, examples=96, stats=stats)
    fields.update(kw)
    return store_lib.Calibration(id=cid, tenant=tenant, **fields)


def test_round_trip_is_exact_and_survives_a_new_store(tmp_path):
    cid = store_lib.CalibrationStore.new_id()
    store_lib.CalibrationStore(tmp_path).save(_cal(cid))
    # A new store over the same directory: what a restarted server sees.
    got = store_lib.CalibrationStore(tmp_path).get("a", cid)
    want = params.flatten(_cal(cid).stats)
    flat = params.flatten(got.stats)
    assert list(flat) == list(want)
    for path, value in want.items():
        assert flat[path].dtype == value.dtype and flat[path].shape == value.shape
        assert flat[path].tobytes() == value.tobytes(), path
    assert (got.batches, got.examples, got.model_key) == (3, 96, '["cnn", {}]')
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{cid}.json", f"{cid}.npz"]


def test_statistic_aliases_survive_the_store(tmp_path):
    # An ODML calibration's jnp.dot statistic serves the PTQ model's dot_general one (issue 40).
    cid = store_lib.CalibrationStore.new_id()
    aliases = {"Dense_0/dot0_lhs": ["Dense_0/dot_general0_lhs", "Dense_1/dot_general0_lhs"]}
    store_lib.CalibrationStore(tmp_path).save(_cal(cid, stat_aliases=aliases))
    assert store_lib.CalibrationStore(tmp_path).get("a", cid).stat_aliases == aliases
    cid2 = store_lib.CalibrationStore.new_id()
    store_lib.CalibrationStore(tmp_path).save(_cal(cid2))
    assert store_lib.CalibrationStore(tmp_path).get("a", cid2).stat_aliases == {}


def test_a_continued_calibration_replaces_the_stored_one(tmp_path):
    store = store_lib.CalibrationStore(tmp_path)
    cid = store.new_id()
    store.save(_cal(cid))
    store.save(_cal(cid, batches=5, examples=160))
    assert store.get("a", cid).batches == 5
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("cid", ["", "../etc/passwd", "ABC", "feedbeef"])
def test_unknown_or_malformed_ids_are_not_found(tmp_path, cid):
    store = store_lib.CalibrationStore(tmp_path)
    with pytest.raises(errors.NotFound) as info:
        store.get("a", cid)
    assert info.value.code == "NOT_FOUND"


def test_another_tenants_calibration_is_not_found(tmp_path):
    store = store_lib.CalibrationStore(tmp_path)
    cid = store.new_id()
    store.save(_cal(cid, tenant="a"))
    with pytest.raises(errors.NotFound) as info:
        store.load_stats("b", cid)
    assert info.value.code == "NOT_FOUND" and cid in str(info.value)
    assert store.load_stats("a", cid)["Dense_0"]["dot_general0_lhs"]["count"] == 3
