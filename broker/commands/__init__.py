"""The client side of the ``broker`` command (§11): ``queues …``, ``publish`` and ``consume``.

``broker.cli`` parses the arguments; ``run`` opens a ``broker.client.Client`` for ``--url`` and
``--token`` (or ``$BROKER_URL``, ``$BROKER_TOKEN``), calls the command's handler, and turns every
failure into one line on stderr naming the contract's error code, and an exit status from
``exits.Exit``. Handlers live in ``queues.py`` and ``messages.py``; what they print, in ``output.py``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import httpx

from broker.client import BrokerError, Client
from broker.client.client import holds_user_info, sendable_token
from broker.commands.exits import CommandError, Exit, exit_for
from broker.commands.messages import consume, publish
from broker.commands.output import Output
from broker.commands.queues import create, dead_letters, delete, inspect, list_queues, peek, purge, redrive

DEFAULT_URL = "http://127.0.0.1:8080"

Handler = Callable[[Client, argparse.Namespace, Output], Exit | None]

HANDLERS: dict[str, Handler] = {
    "queues list": list_queues,
    "queues create": create,
    "queues inspect": inspect,
    "queues peek": peek,
    "queues dlq": dead_letters,
    "queues redrive": redrive,
    "queues purge": purge,
    "queues delete": delete,
    "publish": publish,
    "consume": consume,
}


def run(args: argparse.Namespace) -> int:
    """Run the client command ``args.handler`` names; its exit status."""
    out = Output(as_json=args.json)
    handler = HANDLERS[args.handler]
    url = args.url or os.environ.get("BROKER_URL") or DEFAULT_URL
    token = args.token if args.token is not None else os.environ.get("BROKER_TOKEN")
    if token and not sendable_token(token):  # never quoted: the message would print the secret
        out.error("bad_input", "the token holds a character a header cannot carry")
        return int(Exit.USAGE)
    if holds_user_info(url):  # a password perhaps, wherever it stands: the client refuses it too
        out.error(
            "unreachable",
            "the broker's URL (--url or $BROKER_URL) holds an '@', as user:password@host does, which the "
            "broker does not take; it is not shown: authenticate with --token or $BROKER_TOKEN",
        )
        return int(Exit.UNREACHABLE)
    try:
        client = Client(url, token=token, timeout=args.timeout)
    except (ValueError, httpx.InvalidURL) as error:  # "http://[::1", a port above 65535
        out.error("unreachable", f"{url} is not a URL: {_reason(error)}")
        return int(Exit.UNREACHABLE)
    try:
        with client:
            return int(handler(client, args, out) or Exit.OK)
    except CommandError as error:
        out.error(error.code, error.message)
        return int(error.exit_status)
    except BrokerError as error:
        if not error.well_formed:  # an error status without the broker's error body
            out.error("bad_answer", f"the answer is not the broker's: HTTP {error.status}")
            return int(Exit.FAILED)
        out.error(error.code, error.message)
        return int(exit_for(error.code))
    except (httpx.TransportError, httpx.InvalidURL) as error:
        out.error("unreachable", f"cannot reach {url}: {_reason(error)}")
        return int(Exit.UNREACHABLE)
    except httpx.HTTPError as error:
        out.error("unreachable", f"no valid answer from the broker: {_reason(error)}")
        return int(Exit.UNREACHABLE)
    except ValueError as error:  # an answer that is not the broker's JSON (--url names another server)
        out.error("bad_answer", f"the answer is not the broker's: {error}")
        return int(Exit.FAILED)
    except KeyboardInterrupt:
        out.error("interrupted", "stopped by Ctrl-C")
        return 130


def _reason(error: Exception) -> str:
    text = str(error) or type(error).__name__
    return text.rstrip(".")
