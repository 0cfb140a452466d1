"""A live server on 127.0.0.1 (`python -m serving.launch`, embedded tiny model), started once per test session."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    port = free_port()
    media = tmp_path_factory.mktemp("media")
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [sys.executable, "-m", "serving.launch", "--port", str(port), "--max-streams", "8", "--max-queue", "16",
           "--max-new-tokens", "64", "--max-prompt-rows", "512", "--prefill-chunk", "128",
           "--prefill-packed-rows", "256", "512", "--prefill-lane-rows", "128", "--benchmark-mode",
           "--codec-first-chunk", "4", "--codec-chunk", "8", "--dtype", "float32", "--encode-warmup", "background",
           "--allowed-local-media-path", str(media), "--voices-dir", str(tmp_path_factory.mktemp("voices")),
           "--log-level", "info"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 900
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            proc.kill()
            raise RuntimeError(f"server not healthy in time:\n{log_path.read_text()[-4000:]}")
        yield {"base": base, "media": media, "proc": proc, "log": log_path}
        proc.terminate()  # SIGTERM: readiness goes 503, streams drain, the process exits cleanly
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    log_text = log_path.read_text()
    # uvicorn re-raises the captured SIGTERM after its graceful shutdown, so the exit status is "killed by SIGTERM"
    assert rc in (0, -signal.SIGTERM), log_text[-4000:]
    assert "draining" in log_text and "Application shutdown complete" in log_text
