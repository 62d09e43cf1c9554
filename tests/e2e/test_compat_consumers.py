"""Consumers written the way qhook's and Cloudflare's documents show them, run as separate programs
against a real ``broker serve`` behind tokens (docs/compat.md).

Each consumer is our own code with the documented shape: the same HTTP calls, parameters and control
flow as the document's snippet (qhook: Python ``requests`` and Node ``fetch``; Cloudflare: the pull /
ack loop its guide describes; SimpleQ: its generic ack-mode webhook worker, on ``node:http`` instead of
Express, which is not installed). Changed only where it must run here: the base URL and the key come from
the environment, the endless loop is bounded, and the long-poll ``wait`` is 1 s so an empty round is
short. ``process`` fails for one payload, so the nack path runs too.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_serve import HTTP_TIMEOUT, START_TIMEOUT, Server, ServerProcess

pytestmark = pytest.mark.e2e

ADMIN = "admin-secret-for-tests"
QHOOK_KEY = "billing-key-for-qhook"  # qhook's per-queue key: a token with consume:billing
CLOUDFLARE_TOKEN = "cloudflare-pull-token"  # Cloudflare's API token: a token with consume:cf-*
SIMPLEQ_KEY = "simpleq-worker-api-key"  # the worker's SimpleQ API key: consume:sq-* for its callbacks
CONSUMER_TIMEOUT = 60.0

CONFIG = f"""
[[tokens]]
name = "admin"
secret = "{ADMIN}"
scopes = ["admin"]

[[tokens]]
name = "billing-consumer"
secret = "{QHOOK_KEY}"
scopes = ["consume:billing"]

[[tokens]]
name = "cloudflare-pull"
secret = "{CLOUDFLARE_TOKEN}"
scopes = ["consume:cf-*"]

[[tokens]]
name = "simpleq-worker"
secret = "{SIMPLEQ_KEY}"
scopes = ["consume:sq-*"]

[queues.billing]
max_attempts = 3
dead_letter = "billing-dead"

[queues.billing-dead]

[queues.cf-jobs]
"""

QHOOK_PYTHON = """
import json, os
import requests

BASE = os.environ["QHOOK_BASE"]
QUEUE = "billing"
AUTH = {"Authorization": "Bearer " + os.environ["QHOOK_KEY"]}
processed = []


def process(payload):
    if payload.get("fail"):
        raise ValueError("cannot bill this one")
    processed.append(payload["n"])


for _ in range(int(os.environ["ROUNDS"])):  # the documented loop runs forever
    answer = requests.get(
        f"{BASE}/api/queues/{QUEUE}/messages", params={"wait": "1s", "batch": 5}, headers=AUTH, timeout=15
    )
    answer.raise_for_status()
    messages = answer.json().get("messages", [])
    if not messages:
        continue
    done = []
    for message in messages:
        try:
            process(message["payload"])
            done.append(message["id"])
        except Exception as error:
            print(f"failed {message['id']}: {error}", file=__import__("sys").stderr)
            requests.post(
                f"{BASE}/api/queues/{QUEUE}/nack", json={"ids": [message["id"]]}, headers=AUTH
            ).raise_for_status()
    if done:
        requests.post(f"{BASE}/api/queues/{QUEUE}/ack", json={"ids": done}, headers=AUTH).raise_for_status()
print(json.dumps(sorted(processed)))
"""

QHOOK_NODE = """
const BASE = process.env.QHOOK_BASE;
const QUEUE = "billing";
const HEADERS = {
  Authorization: `Bearer ${process.env.QHOOK_KEY}`,
  "Content-Type": "application/json",
};
const processed = [];

async function handle(payload) {
  if (payload.fail) throw new Error("cannot bill this one");
  processed.push(payload.n);
}

async function post(action, ids) {
  const answer = await fetch(`${BASE}/api/queues/${QUEUE}/${action}`, {
    method: "POST",
    headers: HEADERS,
    body: JSON.stringify({ ids }),
  });
  if (!answer.ok) throw new Error(`${action}: HTTP ${answer.status}`);
}

async function consume() {
  for (let round = 0; round < Number(process.env.ROUNDS); round++) { // the documented loop never ends
    const res = await fetch(`${BASE}/api/queues/${QUEUE}/messages?wait=1s&batch=5`, {
      headers: HEADERS,
      signal: AbortSignal.timeout(15_000),
    });
    if (!res.ok) throw new Error(`receive: HTTP ${res.status}`);
    const { messages } = await res.json();
    if (!messages.length) continue;
    const done = [];
    for (const msg of messages) {
      try {
        await handle(msg.payload);
        done.push(msg.id);
      } catch (err) {
        console.error(`failed ${msg.id}:`, err.message);
        await post("nack", [msg.id]);
      }
    }
    if (done.length) await post("ack", done);
  }
  console.log(JSON.stringify(processed.sort((a, b) => a - b)));
}

consume().catch((err) => {
  console.error(err);
  process.exit(1);
});
"""

CLOUDFLARE_PYTHON = """
import base64, json, os
import requests

BASE = os.environ["CF_BASE"] + "/client/v4/accounts/acct-1/queues/cf-jobs/messages"
AUTH = {"Authorization": "Bearer " + os.environ["CF_TOKEN"]}
processed = []

while True:  # short polling: an empty pull means the queue is drained
    pulled = requests.post(
        f"{BASE}/pull", json={"batch_size": 4, "visibility_timeout_ms": 30000}, headers=AUTH
    ).json()
    assert pulled["success"], pulled
    messages = pulled["result"]["messages"]
    if not messages:
        break
    acks, retries = [], []
    for message in messages:
        body = message["body"]
        if message["metadata"]["CF-Content-Type"] in ("json", "bytes"):
            body = json.loads(base64.b64decode(body))
        if body.get("flaky") and message["attempts"] == 1:
            retries.append({"lease_id": message["lease_id"], "delay_seconds": 0})
        else:
            acks.append({"lease_id": message["lease_id"]})
            processed.append((body["n"], message["attempts"]))
    settled = requests.post(f"{BASE}/ack", json={"acks": acks, "retries": retries}, headers=AUTH).json()
    assert settled["success"], settled
    assert settled["result"]["ackCount"] == len(acks), settled
    assert settled["result"]["retryCount"] == len(retries), settled
print(json.dumps(sorted(processed)))
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("compat")
    config = root / "broker.toml"
    config.write_text(CONFIG)
    process = ServerProcess(root / "data", args=["--config", str(config)])
    try:
        url = process.wait_for_event("listening", START_TIMEOUT)["url"]
        yield Server(process, url)
    finally:
        process.stop()


def admin(server: Server) -> httpx.Client:
    return httpx.Client(
        base_url=server.url, timeout=HTTP_TIMEOUT, headers={"Authorization": f"Bearer {ADMIN}"}
    )


def run(command: list[str], script: str, tmp_path: Path, env: dict[str, str]) -> list[object]:
    source = tmp_path / ("consumer.mjs" if command[0].endswith("node") else "consumer.py")
    source.write_text(script)
    result = subprocess.run(
        [*command, str(source)],
        capture_output=True,
        text=True,
        timeout=CONSUMER_TIMEOUT,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr
    processed: list[object] = json.loads(result.stdout.strip().splitlines()[-1])
    return processed


def publish_billing(server: Server) -> list[str]:
    with admin(server) as http:
        assert http.post("/v1/queues/billing/purge").status_code == 200
        assert http.post("/v1/queues/billing-dead/purge").status_code == 200
        payloads = [{"n": n} for n in range(6)] + [{"fail": True}]
        answer = http.post(
            "/v1/queues/billing/messages", json={"messages": [{"payload": p} for p in payloads]}
        )
        assert answer.status_code == 201, answer.text
        return [ref["id"] for ref in answer.json()["messages"]]


def assert_billing_settled(server: Server, failing_id: str) -> None:
    with admin(server) as http:
        stats = http.get("/v1/queues/billing").json()["stats"]
        assert (stats["ready"], stats["in_flight"], stats["delayed"]) == (0, 0, 0), stats
        dead = http.get("/v1/queues/billing-dead/messages", params={"state": "all"}).json()["messages"]
        assert len(dead) == 1 and dead[0]["payload"] == {"fail": True}
        # nacked until its three attempts were used up, then moved by the queue's dead_letter
        headers = dead[0]["headers"]
        assert (headers["x-dead-letter-reason"], headers["x-dead-letter-attempts"]) == ("max_attempts", "3")
        assert headers["x-original-id"] == failing_id


QHOOK_ENV = {"QHOOK_KEY": QHOOK_KEY, "ROUNDS": "6"}


def test_the_qhook_python_consumer(server: Server, tmp_path: Path) -> None:
    *_, failing = publish_billing(server)
    processed = run(
        [sys.executable], QHOOK_PYTHON, tmp_path, {**QHOOK_ENV, "QHOOK_BASE": f"{server.url}/compat/qhook"}
    )
    assert processed == list(range(6))
    assert_billing_settled(server, failing)


@pytest.mark.skipif(
    shutil.which("node") is None, reason="needs Node.js (node) on PATH for the qhook Node consumer"
)
def test_the_qhook_node_consumer(server: Server, tmp_path: Path) -> None:
    node = shutil.which("node")
    assert node is not None
    *_, failing = publish_billing(server)
    processed = run([node], QHOOK_NODE, tmp_path, {**QHOOK_ENV, "QHOOK_BASE": f"{server.url}/compat/qhook"})
    assert processed == list(range(6))
    assert_billing_settled(server, failing)


def test_the_qhook_key_of_one_queue_opens_no_other(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
        bearer = {"Authorization": f"Bearer {QHOOK_KEY}"}
        assert http.get("/compat/qhook/api/queues/cf-jobs/messages", headers=bearer).status_code == 403
        assert http.get("/compat/qhook/api/queues/billing/messages?wait=0s").status_code == 401


def test_a_cloudflare_pull_consumer(server: Server, tmp_path: Path) -> None:
    with admin(server) as http:
        payloads: list[object] = [{"n": n, "flaky": n % 3 == 0} for n in range(10)]
        answer = http.post(
            "/v1/queues/cf-jobs/messages", json={"messages": [{"payload": p} for p in payloads]}
        )
        assert answer.status_code == 201, answer.text
    processed = run(
        [sys.executable],
        CLOUDFLARE_PYTHON,
        tmp_path,
        {"CF_BASE": f"{server.url}/compat/cloudflare", "CF_TOKEN": CLOUDFLARE_TOKEN},
    )
    # every message once; the flaky ones on their second delivery, after a retry
    assert processed == [[n, 2 if n % 3 == 0 else 1] for n in range(10)]
    with admin(server) as http:
        stats = http.get("/v1/queues/cf-jobs").json()["stats"]
        assert (stats["ready"], stats["in_flight"], stats["acked_total"]) == (0, 0, 10)


SIMPLEQ_ACK_WORKER = """
import crypto from "node:crypto";
import http from "node:http";
import readline from "node:readline";

const { SQ_API_URL, SQ_API_KEY } = process.env;
const EXPECTED = Number(process.env.EXPECTED);
let SIGNING_SECRET = "";
let settled = 0;
const deferredOnce = new Set();

function verifySignature(rawBody, header) {
  if (!header || !SIGNING_SECRET) return false;
  const expected = "sha256=" + crypto.createHmac("sha256", SIGNING_SECRET).update(rawBody).digest("hex");
  const a = Buffer.from(header);
  const b = Buffer.from(expected);
  return a.length === b.length && crypto.timingSafeEqual(a, b);
}

async function callback(jobId, kind, body = {}) {
  const answer = await fetch(`${SQ_API_URL}/v1/jobs/${jobId}/${kind}`, {
    method: "POST",
    headers: { "content-type": "application/json", authorization: `Bearer ${SQ_API_KEY}` },
    body: JSON.stringify(body),
  });
  if (!answer.ok) console.error(`${kind} ${jobId}: HTTP ${answer.status} ${await answer.text()}`);
  if (kind !== "defer" && ++settled === EXPECTED) console.log("settled");
}

async function doTheWork(payload) {
  if (payload.busy) throw Object.assign(new Error("downstream 429"), { status: 429 });
  if (payload.broken) throw Object.assign(new Error("bad request"), { status: 400 });
}

const server = http.createServer((req, res) => {
  const chunks = [];
  req.on("data", (chunk) => chunks.push(chunk));
  req.on("end", async () => {
    const raw = Buffer.concat(chunks);
    if (!verifySignature(raw, req.headers["x-simpleq-signature"])) return res.writeHead(401).end();
    res.writeHead(200).end(); // ack mode: answer at once, report the outcome by callback
    const job = JSON.parse(raw.toString("utf8"));
    try {
      await doTheWork(job.payload);
      await callback(job.id, "ack");
    } catch (err) {
      if (err.status === 429 && !deferredOnce.has(job.id)) {
        deferredOnce.add(job.id); // the downstream is busy once: back later, no attempt spent
        await callback(job.id, "defer", { retryAfter: 0, reason: err.message });
      } else if (err.status >= 400 && err.status < 500 && err.status !== 429) {
        await callback(job.id, "nack", { retryable: false, reason: err.message });
      } else {
        await callback(job.id, "ack");
      }
    }
  });
});
server.listen(0, "127.0.0.1", () => console.log(server.address().port));
readline.createInterface({ input: process.stdin }).once("line", (line) => {
  SIGNING_SECRET = line.trim(); // given once the queue exists: SimpleQ shows it in that answer only
  console.log("ready");
});
"""


def read_line(process: subprocess.Popen[str], timeout: float) -> str:
    """The worker's next stdout line, within ``timeout`` seconds (a thread reads, so the wait is bounded)."""
    lines: queue.Queue[str] = queue.Queue()
    assert process.stdout is not None
    stdout = process.stdout
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=timeout)
    except queue.Empty:
        pytest.fail(f"the worker printed nothing within {timeout} s")
    assert line, f"the worker ended: {process.stderr.read() if process.stderr else ''}"
    return line.strip()


@pytest.mark.skipif(
    shutil.which("node") is None, reason="needs Node.js (node) on PATH for the SimpleQ worker"
)
def test_a_simpleq_ack_mode_worker(server: Server, tmp_path: Path) -> None:
    node = shutil.which("node")
    assert node is not None
    source = tmp_path / "worker.mjs"
    source.write_text(SIMPLEQ_ACK_WORKER)
    api = f"{server.url}/compat/simpleq"
    worker = subprocess.Popen(
        [node, str(source)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "SQ_API_URL": api, "SQ_API_KEY": SIMPLEQ_KEY, "EXPECTED": "4"},
    )
    try:
        port = int(read_line(worker, CONSUMER_TIMEOUT))
        with admin(server) as http:
            created = http.post(
                "/compat/simpleq/v1/queues",
                json={"name": "sq-jobs", "webhookUrl": f"http://127.0.0.1:{port}/webhook", "mode": "ack"},
            )
            assert created.status_code == 201, created.text
            assert worker.stdin is not None
            worker.stdin.write(created.json()["signingSecret"] + "\n")
            worker.stdin.flush()
            assert read_line(worker, CONSUMER_TIMEOUT) == "ready"
            payloads = [{"n": 1}, {"n": 2}, {"busy": True}, {"broken": True}]
            jobs = []
            for payload in payloads:
                published = http.post("/compat/simpleq/v1/queues/sq-jobs/jobs", json={"payload": payload})
                assert published.status_code == 201, published.text
                jobs.append(published.json()["id"])
            # four jobs settled: two acks, a defer then (redelivered) an ack, a hard nack
            assert read_line(worker, CONSUMER_TIMEOUT) == "settled"
            states = {}
            for job_id in jobs:
                deadline = time.monotonic() + HTTP_TIMEOUT  # the last callback's answer is on its way
                while (job := http.get(f"/compat/simpleq/v1/jobs/{job_id}").json())["state"] in (
                    "processing",
                    "awaiting_ack",
                    "queued",
                ):
                    assert time.monotonic() < deadline, job
                    time.sleep(0.02)
                states[job["payload"].get("n") or next(iter(job["payload"]))] = (job["state"], job["attempt"])
        assert states == {
            1: ("completed", 1),
            2: ("completed", 1),
            "busy": ("completed", 1),
            "broken": ("dead", 1),
        }
    finally:
        worker.kill()
        worker.wait(timeout=HTTP_TIMEOUT)
        for pipe in (worker.stdin, worker.stdout, worker.stderr):
            if pipe is not None:
                pipe.close()
