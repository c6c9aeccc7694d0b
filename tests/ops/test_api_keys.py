"""The HTTP API's keys: made per tenant, kept only as private hashes, taken by the server
without a restart."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from pensieve.actors.ingress.openai_api import OpenAIError
from pensieve.ops.api_keys import ApiKeys, keys_dir, new_api_key, remove_api_key


def refused(keys: ApiKeys, key: str | None) -> int:
    with pytest.raises(OpenAIError) as error:
        keys.tenant(key)
    return error.value.status


def test_a_key_names_its_tenant_and_only_its_hash_is_kept(tmp_path: Path) -> None:
    keys = ApiKeys(tmp_path)
    assert refused(keys, "pk-nothing-yet") == 401
    alice = new_api_key(tmp_path, "alice")  # made while the server runs
    bob = new_api_key(tmp_path, "bob")
    assert keys.tenant(alice) == "alice" and keys.tenant(bob) == "bob"
    assert refused(keys, None) == 401 and refused(keys, alice + "x") == 401
    folder = keys_dir(tmp_path)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for path in folder.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert alice not in path.read_text() and bob not in path.read_text()


def test_a_tenants_key_is_never_replaced(tmp_path: Path) -> None:
    first = new_api_key(tmp_path, "alice")
    with pytest.raises(ValueError, match="has an API key"):
        new_api_key(tmp_path, "alice")
    assert ApiKeys(tmp_path).tenant(first) == "alice"


def test_without_accounts_any_key_but_a_tenants_is_the_services(tmp_path: Path) -> None:
    keys = ApiKeys(tmp_path, required=False)
    alice = new_api_key(tmp_path, "alice")
    assert keys.tenant(None) is None and keys.tenant("EMPTY") is None
    assert keys.tenant(alice) == "alice"


def test_a_rotated_or_removed_key_is_refused_at_once(tmp_path: Path) -> None:
    keys = ApiKeys(tmp_path)
    first = new_api_key(tmp_path, "alice")
    bob = new_api_key(tmp_path, "bob")
    assert keys.tenant(first) == "alice"  # read, and held by the running server
    second = new_api_key(tmp_path, "alice", replace=True)
    assert refused(keys, first) == 401 and keys.tenant(second) == "alice"
    remove_api_key(tmp_path, "alice")
    assert refused(keys, second) == 401 and keys.tenant(bob) == "bob"
