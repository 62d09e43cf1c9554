"""docs/workers.md's worker examples run as pasted: each Python block of "A worker to copy" runs in a
process of its own against a broker served from a thread (in memory, ephemeral port), handles a few
messages, and stops cleanly on SIGTERM; the example of "Calls one at a time" runs to its end and
prints what the docs show.

The blocking example names its broker as ``http://127.0.0.1:8080``, which becomes the test broker's
address (as the shell examples' ``localhost:8080`` does in tests/test_doc_examples.py); the async one
reads ``$BROKER_URL``.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

from broker.client import Client

ROOT = Path(__file__).resolve().parents[2]
WORKERS_MD = ROOT / "docs" / "workers.md"
SECTION = "## A worker to copy"
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
#: Real seconds a step may take: a process start, a few messages.
TIMEOUT = 30.0


def examples() -> list[str]:
    text = WORKERS_MD.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    blocks = PYTHON_BLOCK.findall(text[start : end if end >= 0 else len(text)])
    assert len(blocks) == 2, "the blocking worker and the async one"
    return blocks


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@dataclass
class Output:
    """What a process wrote, line by line, read by a thread per pipe, so that neither pipe fills
    and no read can block the test past its deadline."""

    lines: queue.Queue[tuple[str, str]] = field(default_factory=queue.Queue)
    readers: list[threading.Thread] = field(default_factory=list)
    pipes: list[IO[str]] = field(default_factory=list)

    def follow(self, name: str, pipe: IO[str]) -> None:
        self.pipes.append(pipe)

        def read() -> None:
            for line in pipe:
                self.lines.put((name, line.rstrip("\n")))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        self.readers.append(reader)

    def until(self, expected: int, marker: str) -> list[str]:
        """The first ``expected`` lines (of either pipe) that contain ``marker``."""
        seen: list[str] = []
        deadline = time.monotonic() + TIMEOUT
        while len(seen) < expected:
            try:
                _, line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the example did not handle its messages: {seen}") from None
            if marker in line:
                seen.append(line)
        return seen

    def rest(self, name: str) -> str:
        """Everything else the pipe ``name`` wrote, once the process has ended."""
        self.join()
        lines: list[str] = []
        while not self.lines.empty():
            source, line = self.lines.get_nowait()
            if source == name:
                lines.append(line)
        return "\n".join(lines)

    def join(self) -> None:
        for reader in self.readers:
            reader.join(TIMEOUT)

    def close(self) -> None:
        """Once the process has ended: its pipes are at their end, and closed."""
        self.join()
        for pipe in self.pipes:
            pipe.close()


def run_until(code: str, url: str, expected_lines: int, marker: str) -> tuple[list[str], str]:
    """Run ``code`` until it wrote ``expected_lines`` lines containing ``marker`` (on stdout or
    stderr), then SIGTERM it; return those lines and the rest of its stdout. It must exit with
    status 0 within ``TIMEOUT`` of each step."""
    environment = {**os.environ, "BROKER_URL": url, "PYTHONUNBUFFERED": "1"}
    environment.pop("BROKER_TOKEN", None)
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stderr is not None
    output = Output()
    output.follow("stdout", process.stdout)
    output.follow("stderr", process.stderr)
    try:
        seen = output.until(expected_lines, marker)
        process.send_signal(signal.SIGTERM)
        status = process.wait(TIMEOUT)
        assert status == 0, output.rest("stderr")
        return seen, output.rest("stdout")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        output.close()


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")
def test_the_blocking_worker_example_runs_as_pasted(thread_url: str) -> None:
    code = examples()[0].replace("http://127.0.0.1:8080", thread_url)
    with Client(thread_url) as broker:
        broker.create_queue("orders")
        broker.publish("orders", {"id": 0})  # no email: rejected, dead-lettered
        for n in range(1, 4):
            broker.publish("orders", {"id": n, "email": f"user{n}@example.com"})
        confirmations, rest = run_until(code, thread_url, 3, "confirmation sent")
        assert sorted(line.removeprefix("INFO:orders:") for line in confirmations) == [
            f"order {n}: confirmation sent to user{n}@example.com" for n in (1, 2, 3)
        ]
        assert "WorkerStats(" in rest and "acked=3" in rest
        stats = broker.stats("orders")
        assert (stats["acked_total"], stats["in_flight"]) == (3, 0)
        wait_for(lambda: broker.stats("orders.dlq")["ready"] == 1, "the rejected order's dead letter")


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")
def test_the_async_worker_example_runs_as_pasted(thread_url: str) -> None:
    with Client(thread_url) as broker:
        broker.create_queue("orders")
        broker.publish_batch("orders", [{"payload": {"id": n}} for n in range(2)])
        confirmed, _ = run_until(examples()[1], thread_url, 2, "confirmed")
        assert sorted(confirmed) == ["confirmed {'id': 0}", "confirmed {'id': 1}"]
        stats = broker.stats("orders")
        assert (stats["acked_total"], stats["in_flight"]) == (2, 0)


def test_the_calls_example_prints_what_the_docs_say(thread_url: str) -> None:
    """The example of "Calls one at a time", run as pasted, prints its ``text`` block."""
    text = WORKERS_MD.read_text()
    start = text.index("## Calls one at a time")
    found = re.search(r"```python\n(.*?)```\s+prints\s+```text\n(.*?)```", text[start:], re.DOTALL)
    assert found is not None, "the example and what it prints"
    code, printed = found.groups()
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    environment.pop("BROKER_TOKEN", None)
    done = subprocess.run(
        [sys.executable, "-c", code.replace("http://127.0.0.1:8080", thread_url)],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert (done.returncode, done.stdout) == (0, printed), done.stderr
