"""A real ``broker serve --in-memory --port 0`` subprocess for the CLI and doc-example tests."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

START_TIMEOUT = 30.0


@contextmanager
def running_broker(cwd: Path, *options: str) -> Iterator[str]:
    """Start a broker that keeps nothing on disk (with more ``broker serve`` options, such as
    ``--config FILE``); yield its URL; kill it on the way out."""
    process = subprocess.Popen(
        [sys.executable, "-m", "broker", "serve", "--in-memory", "--port", "0", *options],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
    )
    found: dict[str, str] = {}
    listening = threading.Event()

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:  # keep draining, or a chatty server would block on a full pipe
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and record.get("event") == "listening":
                found["url"] = record["url"]
                listening.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not listening.wait(0.05):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the broker did not start (exit status {process.poll()})")
        yield found["url"]
    finally:
        process.kill()
        process.wait(timeout=15)
        reader.join(timeout=15)
        assert process.stderr is not None
        process.stderr.close()
