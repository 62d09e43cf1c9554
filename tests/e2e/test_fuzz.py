"""Schemathesis against a real ``broker serve``: requests generated from ``GET /openapi.json``'s document,
valid and not, for every operation. No answer may be a 5xx; a request the document calls valid must not
be refused as malformed (schemathesis's ``positive_data_acceptance``: no 400, 413, 415 or 422 for it),
so the document and the validators in ``http/parse.py`` agree; and every answer of 400 or more must carry
a JSON body of the contract's ``{"error": {"code", "message"}}`` (§2), whatever its content type says,
or Cloudflare's envelope on its compatibility surface.

Bounded and repeatable: a fixed number of examples per operation, derandomized, no example database.
Two changes to the document keep the run short, not lenient: a claim's ``wait`` is capped at 0.2 s
(a long poll on an empty queue would otherwise wait up to 30 s per example), and the push stream
(``GET …/work``) is left out: an accepted stream never ends by itself (tests/http/test_stream.py).
A third keeps "valid" honest where JSON Schema cannot: a duration's string form (``30s``) is bounded
only in its description, as a pattern cannot bound a magnitude, so the strings generated for it are
its bounds and a value between them, written with units; and a queue's ``dead_letter`` is a name no
generated queue has (a queue cannot be its own dead-letter queue, a rule the document says in words).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error, positive_data_acceptance

from broker.http.openapi import document
from broker.storage.codec import cbor_dumps
from tests.e2e.test_serve import START_TIMEOUT, ServerProcess

pytestmark = pytest.mark.e2e

EXAMPLES = 25  # per operation


def _plain(seconds: float) -> str:
    return f"{seconds:.3f}".rstrip("0").rstrip(".")  # never 1e+07: the duration pattern has no exponent


def _bounded_durations(node: Any) -> None:
    """Replace, everywhere in ``node``, a bounded duration's string pattern by in-range examples."""
    if isinstance(node, dict):
        alternatives = node.get("oneOf")
        if (
            isinstance(alternatives, list)
            and len(alternatives) == 2
            and alternatives[0].get("type") == "number"
            and "maximum" in alternatives[0]
            and alternatives[1].get("type") == "string"
        ):
            low, high = alternatives[0]["minimum"], alternatives[0]["maximum"]
            alternatives[1] = {
                "enum": [f"{_plain(low)}s", f"{(low + high) * 500:.0f}ms", f"{_plain(high)} s"]
            }
        for value in node.values():
            _bounded_durations(value)
    elif isinstance(node, list):
        for value in node:
            _bounded_durations(value)


def _fuzzable() -> dict[str, Any]:
    fuzzed = copy.deepcopy(document())
    _bounded_durations(fuzzed)
    claim = fuzzed["paths"]["/v1/queues/{queue}/claim"]["post"]["requestBody"]["content"]
    for media in claim.values():
        media["schema"]["properties"]["wait"] = {"type": "number", "minimum": 0, "maximum": 0.2}
    del fuzzed["paths"]["/v1/queues/{queue}/work"]
    # A queue cannot be its own dead-letter queue: a rule between the path and the body, which the
    # document can only say in words; generated names are short, so they would often collide.
    config = fuzzed["components"]["schemas"]["QueueConfig"]["properties"]
    config["dead_letter"] = {"enum": [None, "dead-letters"]}
    del config["retry_backoff"]["properties"]["max"]  # nor may its backoff's base be over its max
    redrive = fuzzed["paths"]["/v1/queues/{queue}/redrive"]["post"]["requestBody"]["content"]
    for media in redrive.values():  # nor can a redrive go back to the queue it takes from
        media["schema"]["properties"]["to"] = {"enum": [None, "redriven"]}
    return fuzzed


@schemathesis.serializer("application/cbor")
def _cbor(context: Any, value: Any) -> bytes:
    return cbor_dumps(value)


schema = schemathesis.openapi.from_dict(_fuzzable())


def _whole_numbers_as_integers(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {key: _whole_numbers_as_integers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_whole_numbers_as_integers(item) for item in value]
    return value


@schema.hook
def map_body(context: Any, body: Any) -> Any:
    """``5.0`` as ``5``: JSON Schema counts ``5.0`` an integer, the broker's validators take only ``5``
    where an integer is asked for (a known difference, left as it is: no client sends ``5.0``)."""
    return _whole_numbers_as_integers(body)


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    data: Path = tmp_path_factory.mktemp("fuzz") / "data"
    process = ServerProcess(data)
    try:
        url: str = process.wait_for_event("listening", START_TIMEOUT)["url"]
        with httpx.Client(base_url=url) as http:  # some queues to find, so that not every path is a 404
            for name in ("jobs", "q", "a"):
                assert http.put(f"/v1/queues/{name}", json={"max_attempts": 3}).status_code == 201
                batch = {"messages": [{"payload": n} for n in range(5)]}
                assert http.post(f"/v1/queues/{name}/messages", json=batch).status_code == 201
        yield url
    finally:
        process.stop()


def _error_body(response: Any, path: str) -> None:
    if response.status_code < 400:
        return
    content_type = response.headers.get("content-type", [""])[0]  # header values come as lists
    assert content_type.startswith("application/json"), (response.status_code, content_type, response.content)
    body = response.json()
    if path.startswith("/compat/cloudflare/") and "success" in body:
        # Cloudflare's own envelope (docs/compat.md). What never reaches its routes (the token gate,
        # Quart's routing: a 404 for a path parameter holding a slash) keeps the broker's shape.
        assert body["success"] is False and body["errors"], body
        assert all(set(error) == {"code", "message"} and error["message"] for error in body["errors"]), body
        return
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"code", "message"}, body
    assert isinstance(error["code"], str) and isinstance(error["message"], str) and error["message"], body


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_request_gets_a_5xx_and_every_error_has_the_contract_shape(case: Any, base_url: str) -> None:
    response = case.call(base_url=base_url, timeout=10)
    case.validate_response(response, checks=[not_a_server_error, positive_data_acceptance])
    _error_body(response, case.operation.path)
