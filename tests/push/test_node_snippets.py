"""Node receivers verifying real pushes from a running broker, so that the verification code users copy
cannot rot: SimpleQ's ``verifySignature`` (``x-simpleq-signature``, the raw body alone; its logic as
SimpleQ's docs give it, served with ``node:http`` instead of express) and the Node ``verify`` function
of docs/push.md (``x-broker-signature``), extracted from the document and run as it is written there.

Each receiver answers 200 when the push verifies and 401 when it does not, and prints one JSON line per
request. Node is not a dependency of the project: without it these tests are skipped.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.push.conftest import pushing, wait_until

NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed: the Node snippets cannot run")

DOCS = Path(__file__).resolve().parents[2] / "docs" / "push.md"

#: SimpleQ's receiver, with node:http in place of express.raw (which hands the handler the raw body).
SIMPLEQ_RECEIVER = """
const http = require("node:http");
const crypto = require("node:crypto");

let SIGNING_SECRET = process.env.SQ_SIGNING_SECRET;

function verifySignature(rawBody, header) {
  if (!header) return false;
  const expected =
    "sha256=" + crypto.createHmac("sha256", SIGNING_SECRET).update(rawBody).digest("hex");
  const a = Buffer.from(header);
  const b = Buffer.from(expected);
  return a.length === b.length && crypto.timingSafeEqual(a, b);
}

const server = http.createServer((req, res) => {
  const chunks = [];
  req.on("data", (chunk) => chunks.push(chunk));
  req.on("end", () => {
    const rawBody = Buffer.concat(chunks);
    if (!verifySignature(rawBody, req.headers["x-simpleq-signature"])) {
      console.log(JSON.stringify({ verified: false }));
      res.statusCode = 401;
      return res.end();
    }
    const job = JSON.parse(rawBody.toString("utf8"));
    console.log(JSON.stringify({ verified: true, id: job.id, attempt: job.attempt }));
    res.statusCode = 200;
    res.end();
  });
});
server.listen(0, "127.0.0.1", () => console.log(JSON.stringify({ port: server.address().port })));
process.stdin.once("data", (data) => {
  SIGNING_SECRET = data.toString().trim();
  console.log(JSON.stringify({ secret: "set" }));
});
"""

#: Serves docs/push.md's ``verify`` (prepended to this) on node:http.
BROKER_RECEIVER = """
const http = require("node:http");
let SECRET = "";

const server = http.createServer((req, res) => {
  const chunks = [];
  req.on("data", (chunk) => chunks.push(chunk));
  req.on("end", () => {
    const rawBody = Buffer.concat(chunks);
    const ok = verify(
      SECRET,
      req.headers["x-broker-timestamp"] || "",
      rawBody,
      req.headers["x-broker-signature"],
    );
    const id = ok ? JSON.parse(rawBody.toString("utf8")).id : null;
    console.log(JSON.stringify({ verified: ok, id }));
    res.statusCode = ok ? 200 : 401;
    res.end();
  });
});
server.listen(0, "127.0.0.1", () => console.log(JSON.stringify({ port: server.address().port })));
process.stdin.once("data", (data) => {
  SECRET = data.toString().trim();
  console.log(JSON.stringify({ secret: "set" }));
});
"""


def documented_node_verify() -> str:
    """The ```js block after "Node:" in docs/push.md's "Verifying the signature" section."""
    text = DOCS.read_text()
    section = text[text.index("## Verifying the signature") :]
    found = re.search(r"^Node:\n\n```js\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    assert found is not None, "docs/push.md has no Node block under 'Verifying the signature'"
    snippet = found.group(1)
    assert "function verify(" in snippet
    return snippet


class NodeReceiver:
    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.lines: list[dict[str, Any]] = []
        self._buffer = b""

    async def next_line(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        while b"\n" not in self._buffer:
            chunk = await self.process.stdout.receive_some()
            assert chunk, "node exited"
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        parsed: dict[str, Any] = json.loads(line)
        return parsed

    async def give_secret(self, secret: str) -> None:
        """Send the signing secret (known once the queue exists, which needs the receiver's URL)."""
        assert self.process.stdin is not None
        await self.process.stdin.send_all(secret.encode() + b"\n")
        with trio.fail_after(20):
            assert await self.next_line() == {"secret": "set"}

    async def record(self) -> None:
        while True:
            self.lines.append(await self.next_line())


@asynccontextmanager
async def node_receiver(script: str, tmp_path: Path) -> AsyncIterator[tuple[str, NodeReceiver]]:
    """Run ``script`` under node; yields its URL and the receiver recording its lines."""
    assert NODE is not None
    path = tmp_path / "receiver.js"
    path.write_text(script)
    async with trio.open_nursery() as nursery:
        process = await nursery.start(
            partial(
                trio.run_process,
                [NODE, str(path)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                check=False,
            )
        )
        receiver = NodeReceiver(process)
        with trio.fail_after(20):
            port = (await receiver.next_line())["port"]
        yield f"http://127.0.0.1:{port}/webhook", receiver
        nursery.cancel_scope.cancel()  # run_process kills node


@pytest.mark.parametrize("right_secret", [True, False])
async def test_simpleq_verify_signature_in_node_accepts_a_real_push(
    tmp_path: Path, right_secret: bool
) -> None:
    async with pushing() as p, node_receiver(SIMPLEQ_RECEIVER, tmp_path) as (url, receiver):
        answer = await p.client.post("/compat/simpleq/v1/queues", json={"name": "ai-jobs", "webhookUrl": url})
        assert answer.status_code == 201
        secret = (await answer.get_json())["signingSecret"]
        await receiver.give_secret(secret if right_secret else "x" * 64)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receiver.record)
            answer = await p.client.post("/compat/simpleq/v1/queues/ai-jobs/jobs", json={"payload": {"n": 1}})
            job_id = (await answer.get_json())["id"]
            counter = "acked_total" if right_secret else "refused_total"
            await wait_until(lambda: (p.supervisor.status("ai-jobs") or {}).get(counter) == 1, within=20)
            await wait_until(lambda: bool(receiver.lines), within=20)
            nursery.cancel_scope.cancel()
    if right_secret:
        assert receiver.lines == [{"verified": True, "id": job_id, "attempt": 1}]
    else:
        assert receiver.lines == [{"verified": False}]


@pytest.mark.parametrize("right_secret", [True, False])
async def test_the_node_verify_of_docs_push_md_accepts_a_real_push(
    tmp_path: Path, right_secret: bool
) -> None:
    script = documented_node_verify() + BROKER_RECEIVER
    async with pushing() as p, node_receiver(script, tmp_path) as (url, receiver):
        answer = await p.client.put("/v1/queues/emails", json={"push": {"url": url}})
        assert answer.status_code == 201
        secret = (await answer.get_json())["config"]["push"]["secret"]
        await receiver.give_secret(secret if right_secret else "y" * 64)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receiver.record)
            answer = await p.client.post(
                "/v1/queues/emails/messages", json={"payload": {"to": "a@example.com"}}
            )
            message_id = (await answer.get_json())["messages"][0]["id"]
            counter = "acked_total" if right_secret else "refused_total"
            await wait_until(lambda: (p.supervisor.status("emails") or {}).get(counter) == 1, within=20)
            await wait_until(lambda: bool(receiver.lines), within=20)
            nursery.cancel_scope.cancel()
    expected = {"verified": True, "id": message_id} if right_secret else {"verified": False, "id": None}
    assert receiver.lines == [expected]
