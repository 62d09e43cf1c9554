"""Where the server's CPU time goes on the HTTP path: one drain run sampled by py-spy.

py-spy (``.venv/bin/pip install py-spy``; not a project dependency) samples the server process from
outside, so the server runs unmodified. It records a speedscope profile (open it at
https://www.speedscope.app) which this module also summarises: the share of samples per layer (the
broker's core, its actor, its HTTP routes, Quart, Hypercorn/h11, Trio) and the heaviest functions.

Idle samples (the event loop waiting in epoll) are left out by py-spy, so the shares are shares of CPU
time. Time in C code (orjson, the ``socket`` module) is counted in the Python function that called it.
"""

from __future__ import annotations

import collections
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from bench import http_api
from bench.server import running_server

SAMPLE_RATE = 200  # per second
ATTACH_PAUSE = 1.0  # seconds for py-spy to attach before the drain starts

#: Layers, in the order a frame's file is tested against them. A frame that is in none of them (the
#: standard library: contextlib, abc, socket...) counts towards the nearest caller that is.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("broker core (queue state machine)", ("broker/core/",)),
    ("broker storage/codec.py (JSON decode and encode)", ("broker/storage/codec.py",)),
    (
        "broker actor, registry, journal",
        ("broker/actor.py", "broker/registry.py", "broker/storage/", "broker/clock.py"),
    ),
    ("broker HTTP routes (parse, render, JSON)", ("broker/http/",)),
    (
        "Quart / Werkzeug (request, response, routing)",
        ("quart/", "quart_trio/", "werkzeug/", "flask/", "blinker/"),
    ),
    ("Hypercorn / h11 (HTTP/1.1 protocol)", ("hypercorn/", "h11/", "wsproto/", "h2/")),
    ("socket send/recv system calls (trio/_socket.py)", ("trio/_socket.py",)),
    ("epoll (trio/_core/_io_epoll.py)", ("trio/_core/_io_epoll.py",)),
    ("Trio (scheduler, cancel scopes, locks, streams)", ("trio/", "outcome/", "sniffio/")),
    ("structlog", ("structlog/",)),
]
OTHER = "other (interpreter start-up, stdlib at the root)"

#: Functions whose inclusive share is worth reporting on their own: (label, file part, function name).
KEY_FRAMES = [
    ("route publish (app.py)", "broker/http/app.py", "publish"),
    ("route claim (app.py)", "broker/http/app.py", "claim"),
    ("route ack (app.py)", "broker/http/app.py", "ack"),
    ("route ack (app.py)", "broker/http/app.py", "settle"),  # later versions: settle_route(...)
    # Since the fast path: the route functions live in routes.py, the ASGI handling in fastpath.py.
    ("route publish (routes.py)", "broker/http/routes.py", "publish"),
    ("route claim (routes.py)", "broker/http/routes.py", "claim"),
    ("route ack, nack, defer, extend (routes.py)", "broker/http/routes.py", "handle"),
    (
        "fast path: a hot request, route and answer included (fastpath.py)",
        "broker/http/fastpath.py",
        "_serve",
    ),
    ("fast path: body read + decode (read_body)", "broker/http/fastpath.py", "read_body"),
    ("fast path: long poll with a disconnect watcher", "broker/http/fastpath.py", "long_poll"),
    ("response encoding (routes.encode)", "broker/http/routes.py", "encode"),
    ("request body read + decode (_body)", "broker/http/app.py", "_body"),
    ("codec.json_loads (big-integer scan + orjson.loads)", "broker/storage/codec.py", "json_loads"),
    ("response encoding (respond)", "broker/http/app.py", "respond"),
    ("parse.publish (per-message validation, payload encoding)", "broker/http/parse.py", "publish"),
    ("render.deliveries (delivery dicts, timestamps)", "broker/http/render.py", "deliveries"),
    ("QueueActor.request (send command, wait for reply)", "broker/actor.py", "request"),
    ("QueueActor.run (the actor's loop)", "broker/actor.py", "run"),
    ("QueueCore.publish", "broker/core/queue.py", "publish"),
    ("QueueCore.claim", "broker/core/queue.py", "claim"),
    ("QueueCore.ack", "broker/core/queue.py", "ack"),
    ("Hypercorn H11Protocol (parse + send)", "hypercorn/protocol/h11.py", "*"),
    ("trio socket send/recv", "trio/_socket.py", "*"),
]


def find_py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def profile_drain(scale: str, output: Path, *, durable: bool = False) -> dict[str, Any]:
    """Run one extra drain (the ``http`` benchmark's, or with ``durable`` the ``durable`` one's) with
    py-spy recording the server."""
    py_spy = find_py_spy()
    if py_spy is None:
        return {"error": "py-spy is not installed; run .venv/bin/pip install py-spy"}
    counts = http_api.DRAIN[scale]
    output.parent.mkdir(parents=True, exist_ok=True)
    with running_server(durable=durable) as server:
        recorder = subprocess.Popen(
            [
                py_spy, "record", "--pid", str(server.pid), "--rate", str(SAMPLE_RATE), "--function",
                "--format", "speedscope", "--output", str(output),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            time.sleep(ATTACH_PAUSE)
            if recorder.poll() is not None:
                error = recorder.stderr.read().decode(errors="replace") if recorder.stderr else ""
                return {"error": f"py-spy exited {recorder.returncode}: {error.strip()[-300:]}"}
            run = http_api.drain_once(server, "profiled", counts["messages"], counts["consumers"])
        finally:
            if recorder.poll() is None:
                recorder.send_signal(signal.SIGINT)  # py-spy writes its output on Ctrl-C
                try:
                    recorder.wait(30)
                except subprocess.TimeoutExpired:
                    recorder.kill()
                    recorder.wait()
    if not output.exists():
        return {"error": "py-spy wrote no profile"}
    return {"speedscope_file": str(output), "drain_while_profiled": run, **summarise(output)}


def _layer(path: str) -> str | None:
    for name, parts in LAYERS:
        if any(part in path for part in parts):
            return name
    return None


def summarise(speedscope_file: Path) -> dict[str, Any]:
    """Shares of samples per layer (self time), per key frame (inclusive), and the top functions."""
    document = orjson.loads(speedscope_file.read_bytes())
    frames = document["shared"]["frames"]
    frame_layers = [_layer(frame.get("file") or "") for frame in frames]
    layer_self: collections.Counter[str] = collections.Counter()
    function_self: collections.Counter[str] = collections.Counter()
    key_inclusive: collections.Counter[str] = collections.Counter()
    total = 0.0
    count = 0
    for profile in document["profiles"]:
        for stack, weight in zip(profile["samples"], profile["weights"], strict=True):
            total += weight
            count += 1
            layer = next((frame_layers[i] for i in reversed(stack) if frame_layers[i] is not None), OTHER)
            layer_self[layer] += weight
            leaf = frames[stack[-1]] if stack else {"name": "?", "file": "?"}
            function_self[f"{leaf['name']} ({_short(leaf.get('file') or '?')})"] += weight
            seen = set()
            for index in stack:
                frame = frames[index]
                for label, file_part, function in KEY_FRAMES:
                    if (
                        label not in seen
                        and file_part in (frame.get("file") or "")
                        and (function in ("*", frame["name"]) or frame["name"].endswith(f".{function}"))
                    ):
                        seen.add(label)
            for label in seen:
                key_inclusive[label] += weight
    if not total:
        return {"samples": 0, "sampled_seconds": 0.0}

    def share(value: float) -> float:
        return round(100 * value / total, 1)

    return {
        "samples": count,
        "sampled_seconds": round(total, 2),
        "layers_self_percent": {name: share(value) for name, value in layer_self.most_common()},
        "key_frames_inclusive_percent": {
            label: share(key_inclusive[label])
            for label in dict.fromkeys(label for label, _, _ in KEY_FRAMES)
            if key_inclusive[label]
        },
        "top_functions_self_percent": {name: share(value) for name, value in function_self.most_common(20)},
    }


def _short(path: str) -> str:
    for marker in ("site-packages/", "/work/main/", "lib/python3."):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def describe(profile: dict[str, Any]) -> str:
    """The summary as text for the terminal."""
    if "error" in profile:
        return f"profile: {profile['error']}"
    run = profile["drain_while_profiled"]
    lines = [
        f"HTTP drain of {run['messages']:,} messages under py-spy: {run['drain_per_second']:,.0f} msg/s "
        f"while profiled; server CPU {run['server_cpu_seconds']:.2f} s "
        f"({run['server_cpu_microseconds_per_message']:.0f} µs per message); "
        f"{profile['samples']} samples at {SAMPLE_RATE}/s = {profile['sampled_seconds']:.2f} s busy",
        f"  speedscope profile: {profile['speedscope_file']}",
        "  self time by layer:",
    ]
    lines += [f"    {value:5.1f}%  {name}" for name, value in profile["layers_self_percent"].items()]
    lines.append("  inclusive time of key frames:")
    lines += [f"    {value:5.1f}%  {name}" for name, value in profile["key_frames_inclusive_percent"].items()]
    lines.append("  top functions by self time:")
    lines += [f"    {value:5.1f}%  {name}" for name, value in profile["top_functions_self_percent"].items()]
    return "\n".join(lines)
