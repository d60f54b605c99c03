"""The verifier's and the drafter's ``--kv-cache`` setting: auto by default, paged or contiguous by
name, anything else refused at start-up."""

from __future__ import annotations

import pytest

from common.platform.settings import SettingsError, load_settings
from services.drafter.settings import DrafterSettings
from services.verifier.settings import VerifierSettings


@pytest.mark.parametrize("cls", [VerifierSettings, DrafterSettings])
def test_kv_cache_setting(cls) -> None:
    assert load_settings(cls, [], {}).kv_cache == "auto"
    assert load_settings(cls, ["--kv-cache", "paged"], {}).kv_cache == "paged"
    assert load_settings(cls, [], {"COSINE_KV_CACHE": "contiguous"}).kv_cache == "contiguous"
    with pytest.raises((SettingsError, SystemExit)):
        load_settings(cls, ["--kv-cache", "ring"], {})
