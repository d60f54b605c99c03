"""API keys: loading, bearer parsing, constant-time check (unit level; the gateway test drives the
interceptor over real gRPC)."""

from __future__ import annotations

import pytest

from common.platform.settings import settings_as_dict
from services.gateway.auth import ApiKeyError, bearer_token, key_is_valid, load_api_keys
from services.gateway.settings import GatewaySettings


def test_keys_from_list_and_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team keys\nk-file-1\n\n  k-file-2  \n")
    assert load_api_keys(("k-env", " ", ""), str(path)) == {"k-env", "k-file-1", "k-file-2"}
    assert load_api_keys() == frozenset()


def test_unreadable_key_file_names_the_path(tmp_path):
    with pytest.raises(ApiKeyError, match="missing-keys"):
        load_api_keys((), str(tmp_path / "missing-keys"))


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer abc", "abc"),
        ("bearer  abc ", "abc"),
        ("Basic abc", None),
        ("Bearer", None),
        ("", None),
        (None, None),
    ],
)
def test_bearer_token(header, token):
    assert bearer_token(header) == token


def test_key_check():
    keys = frozenset({"alpha", "beta"})
    assert key_is_valid("beta", keys)
    assert not key_is_valid("bet", keys)
    assert not key_is_valid("", keys)
    assert not key_is_valid(None, keys)
    assert not key_is_valid("alpha", frozenset())


def test_keys_never_logged():
    settings = GatewaySettings(api_keys=("secret-1", "secret-2"))
    logged = settings_as_dict(settings)
    assert "secret-1" not in repr(logged)
    assert logged["api_keys"] == "<2 hidden>"
