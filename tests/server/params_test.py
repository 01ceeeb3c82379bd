"""The server's one flatten / unflatten of parameter paths, and unwrapping a params collection."""

import numpy as np
import pytest

from qmill.server import params


def test_flatten_and_unflatten_are_inverse():
    tree = {"a": {"b": np.ones(2), "c": {"d": np.zeros(())}}, "e": np.arange(3)}
    flat = params.flatten(tree)
    assert list(flat) == ["a/b", "a/c/d", "e"]
    back = params.unflatten(flat)
    assert back.keys() == tree.keys() and back["a"]["c"]["d"].shape == ()
    assert back["a"]["b"] is tree["a"]["b"]  # leaves are kept as they are, never copied


@pytest.mark.parametrize(
    ("flat", "needle"),
    [
        ({"a": 1, "a/b": 2}, "'a/b' nests under another tensor's path"),
        ({"a/b": 2, "a": 1}, "'a' is also the parent of other tensors"),
    ],
)
def test_a_path_that_is_both_leaf_and_parent_is_refused(flat, needle):
    with pytest.raises(ValueError, match=needle):
        params.unflatten(flat)


def test_unwrap_takes_the_params_collection_out_of_flax_variables():
    inner = {"Dense_0": {"kernel": np.ones(2)}}
    assert params.unwrap({"params": inner}) is inner
    assert params.unwrap(inner) is inner
    assert params.unwrap({"params": inner, "batch_stats": {}})["params"] is inner
