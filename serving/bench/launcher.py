"""Start a fresh server for one concurrency level, wait for GET /health, stop it after."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx


def healthy(base_url: str) -> bool:
    try:
        return httpx.get(base_url.rstrip("/") + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def launch_argv(cmd: str, base_url: str, concurrency: int) -> list[str]:
    """`{port}` and `{concurrency}` in the command become the base URL's port and the level."""
    port = urlparse(base_url).port or 80
    return shlex.split(cmd.replace("{port}", str(port)).replace("{concurrency}", str(concurrency)))


class LaunchedServer:
    """Context manager: the server process, its output in log_path; SIGTERM (then SIGKILL) on exit."""

    def __init__(self, cmd: str, base_url: str, concurrency: int, log_path: Path, timeout: float):
        self.argv = launch_argv(cmd, base_url, concurrency)
        self.base_url, self.log_path, self.timeout = base_url, log_path, timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LaunchedServer:
        if healthy(self.base_url):
            raise RuntimeError(f"a server already answers at {self.base_url}; --launch needs a free port")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.timeout
        while not healthy(self.base_url):
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self._tail()}")
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"server not healthy after {self.timeout:.0f} s:\n{self._tail()}")
            time.sleep(0.3)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the server and any workers it started
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def _tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]
