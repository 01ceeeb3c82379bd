"""Token tables, principals and the helpers servicers use to scope by tenant."""

from __future__ import annotations

import asyncio
import hashlib
import json

import grpc
import pytest

from qmill.server import auth, errors


def test_toml_table_maps_tokens_to_principals(tmp_path):
    path = tmp_path / "tokens.toml"
    digest = hashlib.sha256(b"ops-secret-token").hexdigest()
    path.write_text(
        '"team-a-secret" = { tenant = "team-a", role = "user" }\n'
        '"team-b-secret" = { tenant = "team-b" }\n'
        f'"sha256:{digest}" = {{ tenant = "ops", role = "admin" }}\n'
    )
    table = auth.TokenTable.load(path)
    assert table.principal("team-a-secret") == auth.Principal(tenant="team-a", role="user")
    assert table.principal("team-b-secret") == auth.Principal(tenant="team-b", role="user")
    assert table.principal("ops-secret-token") == auth.Principal(tenant="ops", role="admin")
    assert table.principal("team-a-secreT") is None
    assert table.principal("") is None
    # Only digests are kept in memory.
    assert all(len(k) == 32 for k in table.by_digest)


def test_json_file_and_environment_variable(tmp_path):
    mapping = {"tok-1": {"tenant": "a", "role": "admin"}}
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps(mapping))
    assert auth.TokenTable.load(path).principal("tok-1").is_admin
    from_env = auth.TokenTable.from_env({auth.TOKENS_ENV: json.dumps(mapping)})
    assert from_env.principal("tok-1") == auth.Principal(tenant="a", role="admin")
    assert auth.TokenTable.from_env({}) is None


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({}, "non-empty mapping"),
        ({"t": {"tenant": "a", "role": "root"}}, "role one of"),
        ({"t": {"role": "user"}}, "string 'tenant'"),
        ({"t": {"tenant": ""}}, "tenant must be non-empty"),
        ({"t": {"tenant": "a", "rol": "admin"}}, "no other keys"),
        ({"sha256:abcd": {"tenant": "a"}}, "64 hex digits"),
        ({"": {"tenant": "a"}}, "empty token"),
        ({"t": "a"}, "string 'tenant'"),
    ],
)
def test_bad_tables_are_refused_with_the_reason(mapping, message):
    with pytest.raises(ValueError, match=message):
        auth.TokenTable.from_mapping(mapping)


def test_bad_file_syntax_names_the_file(tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text("not = [toml")
    with pytest.raises(ValueError, match=r"tokens\.toml: not valid"):
        auth.TokenTable.load(path)


def test_helpers_raise_errors_that_map_to_the_right_codes():
    async def as_user():
        auth._principal.set(auth.Principal(tenant="team-a", role="user"))
        auth.require_owner("team-a", "job 1")  # own tenant: fine
        with pytest.raises(errors.PermissionDenied) as denied:
            auth.require_admin("drain")
        with pytest.raises(errors.NotFound) as missing:
            auth.require_owner("team-b", "job 2")
        return denied.value, missing.value

    denied, missing = asyncio.run(as_user())
    assert errors.status_for(denied) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "drain needs an admin token; tenant 'team-a' has role 'user'",
    )
    # The same words as an id that does not exist: other tenants' ids cannot be probed.
    assert errors.status_for(missing) == (grpc.StatusCode.NOT_FOUND, "job 2 not found")


def test_outside_a_call_the_principal_is_the_local_admin():
    assert auth.current_principal() == auth.LOCAL
    assert auth.require_admin() == auth.LOCAL


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _write_tokens(path, mapping):
    # Write then rename, as config management (and a Kubernetes Secret's link swap) does.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(mapping if isinstance(mapping, str) else json.dumps(mapping))
    tmp.replace(path)


def test_token_file_is_reread_when_it_changes_at_most_once_per_interval(tmp_path):
    path, clock = tmp_path / "tokens.json", _Clock()
    _write_tokens(path, {"tok-a": {"tenant": "a"}})
    tokens = auth.TokenFile(path, clock=clock)
    assert tokens.principal("tok-a").tenant == "a"
    _write_tokens(path, {"tok-b": {"tenant": "b", "role": "admin"}})
    clock.now = 0.5  # not due yet: the file is not even looked at
    assert tokens.principal("tok-b") is None and tokens.principal("tok-a").tenant == "a"
    clock.now = 1.0
    assert tokens.principal("tok-b").is_admin and tokens.principal("tok-a") is None


@pytest.mark.parametrize(
    "bad",
    ["not json", {}, {"tok": {"tenant": "a", "role": "root"}}, None],
    ids=["syntax", "empty", "bad-entry", "missing"],
)
def test_a_bad_new_token_file_keeps_the_tokens_in_use_and_logs_once(tmp_path, caplog, bad):
    path, clock = tmp_path / "tokens.json", _Clock()
    _write_tokens(path, {"tok-a": {"tenant": "a"}})
    tokens = auth.TokenFile(path, clock=clock)
    if bad is None:
        path.unlink()
    else:
        _write_tokens(path, bad)
    for second in (1, 2, 3):
        clock.now = second
        assert tokens.principal("tok-a").tenant == "a"  # nobody locked out
        assert tokens.principal("tok") is None  # nobody let in
    errors_logged = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors_logged) == 1 and "keeping the 1 tokens in use" in errors_logged[0].message
    _write_tokens(path, {"tok-c": {"tenant": "c"}})  # fixed: applied at the next check
    clock.now = 4
    assert tokens.principal("tok-c").tenant == "c" and tokens.principal("tok-a") is None


def test_a_token_file_that_does_not_load_at_start_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        auth.TokenFile(tmp_path / "absent.toml")
    (tmp_path / "bad.toml").write_text("x = ")
    with pytest.raises(ValueError, match="not valid"):
        auth.TokenFile(tmp_path / "bad.toml")
