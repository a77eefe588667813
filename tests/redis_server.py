"""A real ``redis-server`` process for tests, on a free 127.0.0.1 port, always stopped (context manager)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from tests.helpers import free_port, wait_until


class RedisServer:
    """Start/stop/restart a throw-away redis-server (no persistence). ``url`` is ``redis://127.0.0.1:PORT/0``."""

    def __init__(self, port: int | None = None) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not on PATH (make test installs it)")
        self.port = port or free_port()
        self._dir = tempfile.mkdtemp(prefix="kvroute-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Connection URL."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING."""
        self._proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self._dir,
                "--logfile",
                str(Path(self._dir) / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5)
        try:
            wait_until(lambda: client.ping(), 10.0, what=f"redis-server on {self.port}")
        finally:
            client.close()
        return self

    def stop(self) -> None:
        """Kill the server (SIGKILL: a crash, nothing saved)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._proc = None

    def restart(self, down_s: float = 0.0) -> None:
        """Kill, stay down ``down_s`` seconds, start again on the same port (empty data)."""
        self.stop()
        if down_s > 0:
            time.sleep(down_s)
        self.start()

    def alive(self) -> bool:
        """True while the process runs."""
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)
