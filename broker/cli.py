"""The ``broker`` command.

Only the standard library is imported at module level: ``main`` imports the rest once it runs, inside
its ``try``, so that a Ctrl-C in the first instants (importing trio or httpx takes a few hundred
milliseconds) is the documented ``broker: interrupted`` and exit 130, not a traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

from broker import __version__

E = TypeVar("E", bound=BaseException)

#: Queue names (§2), checked before any request, so that ``bad/name`` is bad input rather than a URL
#: the broker does not route. ``broker.core.config`` has the same (importing it takes ~90 ms: the core).
QUEUE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: The exit statuses ``main`` gives itself (``broker.commands.exits`` has the others): a usage error,
#: a reader of stdout that went away (as a shell reports a command killed by SIGPIPE), and Ctrl-C.
USAGE = 2
BROKEN_PIPE = 141
INTERRUPTED = 130


def _first(error: BaseException, kind: type[E]) -> E | None:
    """The first ``kind`` inside ``error`` (Trio nurseries wrap errors in exception groups)."""
    if isinstance(error, kind):
        return error
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            found = _first(inner, kind)
            if found is not None:
                return found
    return None


class UsageError(Exception):
    """A command line argparse cannot use (``Parser.error``), for ``main`` to report."""


#: Where ``Parser.parse_known_args`` leaves the parser of the command that was given.
_COMMAND_PARSER = "_command_parser"


def _given_after(arguments: list[str], words: list[str], extra: str) -> bool:
    """Whether ``extra`` stands in ``arguments`` after the command's ``words`` (``queues``, ``list``)."""
    position = 0
    for word in words:
        try:
            position = arguments.index(word, position) + 1
        except ValueError:
            return True
    return extra not in arguments or arguments.index(extra) >= position


#: The longest run of misplaced options and their values ``_refuse_option_before_command`` looks past.
_MISPLACED_RUN = 8


def _without_values(words: list[str]) -> list[str]:
    """Unrecognised arguments as a usage error shows them: a value (after an option, after ``=``, or
    holding an ``@``) as ``…``, since it may be a token or a URL's password (``--url`` given to a
    command that takes none)."""
    shown = []
    for index, word in enumerate(words):
        if word.startswith("-"):
            flag, equals, _ = word.partition("=")
            shown.append(f"{flag}=…" if equals else flag)
        elif (index and words[index - 1].startswith("-") and "=" not in words[index - 1]) or "@" in word:
            shown.append("…")
        else:
            shown.append(word)
    return shown


class Parser(argparse.ArgumentParser):
    """argparse's parser, but a usage error is one line naming ``bad_input`` like every other error
    (docs/cli.md), JSON with ``--json``, not the usage text; ``--help`` is unchanged. Subparsers are
    of the class of their parent, so every command's parser is one of these."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        # The innermost command's parser parses first; the commands around it keep its name.
        if not hasattr(parsed, _COMMAND_PARSER):
            setattr(parsed, _COMMAND_PARSER, self)
        return parsed, extras

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """As argparse's, but an unknown flag is refused by the command it was given to, so the error
        points at that command's ``--help`` rather than ``broker --help``; one the command takes but
        that was given before its name (``broker --json queues list``) is told where it goes."""
        arguments = list(sys.argv[1:] if args is None else args)
        try:
            parsed, extras = self.parse_known_args(arguments, namespace)
        except UsageError as error:
            self._refuse_option_before_command(arguments)
            if "invalid choice" not in str(error):
                raise
            # argparse took the value of an option given before the command's name for the command,
            # and quotes it: a token, or a URL's password (``broker --token SECRET snapshot list``).
            message = str(error)
            for word, shown in zip(arguments, _without_values(arguments), strict=True):
                if word != shown:
                    message = message.replace(repr(word), "…")
            raise UsageError(message) from None
        if not extras:
            return parsed
        command: argparse.ArgumentParser = getattr(parsed, _COMMAND_PARSER, self)
        unknown = f"unrecognized arguments: {' '.join(_without_values(extras))}"
        if command is self or _given_after(arguments, command.prog.split()[1:], extras[0]):
            command.error(unknown)
        flag = extras[0].partition("=")[0]
        if flag in command._option_string_actions:
            command.error(f"{flag} goes after the command's name: {command.prog} {flag} …")
        self.error(unknown)

    def _refuse_option_before_command(self, arguments: list[str]) -> None:
        """Tell where an option goes when it was given before the command's name (``broker --url URL
        queues list``, ``broker --json --url URL queues list``, ``broker queues --url URL list``),
        where argparse took its value for the command: the command is the one the arguments name once
        a run of options and values from the first such option on is left out, and the option is that
        command's, given before its last word."""
        for start, argument in enumerate(arguments):
            flag = argument.partition("=")[0]
            if not flag.startswith("-") or flag in self._option_string_actions:
                continue
            for end in range(start + 1, min(start + _MISPLACED_RUN, len(arguments)) + 1):
                try:
                    parsed, extras = self.parse_known_args(arguments[:start] + arguments[end:])
                except UsageError:
                    continue
                command: argparse.ArgumentParser = getattr(parsed, _COMMAND_PARSER, self)
                named_after = command.prog.split()[-1] in arguments[end:]
                if not extras and named_after and flag in command._option_string_actions:
                    command.error(f"{flag} goes after the command's name: {command.prog} {flag} …")
            return

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        sys.stdout.flush()  # `--help | head -0`: a closed stdout fails here, for main, not at exit
        super().exit(status, message)


def build_parser() -> argparse.ArgumentParser:
    from broker.config import DEFAULT_DATA_DIR, DEFAULT_HOST, DEFAULT_PORT

    parser = Parser(prog="broker", description="A lease-based job broker over HTTP.")
    parser.add_argument("--version", action="version", version=f"broker {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run the broker",
        description="Run the broker. Settings come from defaults, then --config FILE, then BROKER_* "
        "environment variables, then these flags (see docs/operations.md).",
    )
    serve.add_argument("--config", type=Path, metavar="FILE", help="a TOML file of settings, tokens, queues")
    serve.add_argument("--host", help=f"address to listen on (default {DEFAULT_HOST})")
    serve.add_argument("--port", help=f"port (default {DEFAULT_PORT}; 0 = any free)")
    serve.add_argument("--data-dir", help=f"where the broker keeps its data (default ./{DEFAULT_DATA_DIR})")
    serve.add_argument(
        "--in-memory",
        action="store_const",
        const=True,
        help="keep the journal in memory and write nothing: a restart starts empty (tests, benchmarks)",
    )
    serve.add_argument(
        "--insecure",
        action="store_const",
        const=True,
        help="serve on a non-loopback address without tokens (refused otherwise)",
    )
    serve.add_argument(
        "--snapshot-interval", metavar="DURATION", help="time between snapshots, e.g. 60s (default) or 5m"
    )
    serve.add_argument(
        "--snapshot-bytes",
        metavar="SIZE",
        help="also snapshot once the journal grew by SIZE, e.g. 64MiB (default), or 'unlimited'",
    )
    serve.add_argument(
        "--journal-retention-bytes",
        metavar="SIZE",
        help="keep at most SIZE of journal that snapshots cover, e.g. 4GiB (default), or 'unlimited'",
    )
    serve.add_argument(
        "--journal-retention-age",
        metavar="DURATION",
        help="keep journal that snapshots cover for DURATION, e.g. 7d (default), or 'unlimited'",
    )
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="default info")

    snapshot = commands.add_parser(
        "snapshot", help="list, verify or restore snapshots (broker stopped), or back up the data directory"
    )
    actions = snapshot.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, text in (
        ("list", "the snapshots, newest first"),
        ("verify", "check every snapshot's checksum and the journal's frames"),
        ("restore", "make a snapshot, or the state at a time, the newest state"),
        ("backup", "copy the data directory to DEST, safe while the broker runs"),
    ):
        action = actions.add_parser(name, help=text, description=text)
        action.add_argument(
            "--data-dir",
            type=Path,
            default=DEFAULT_DATA_DIR,
            help=f"the broker's data directory (default ./{DEFAULT_DATA_DIR}); never created",
        )
        action.add_argument("--json", action="store_true", help="print one JSON document, for scripts")
        if name == "backup":
            action.add_argument("dest", type=Path, help="a new directory, outside the data directory")
        if name == "restore":
            action.add_argument("id", nargs="?", help="the snapshot to restore (see list)")
            action.add_argument(
                "--until", help="restore the state as of this time, e.g. 2026-11-22T10:00:00Z"
            )
    _add_client_commands(commands)
    return parser


def _client_options() -> Parser:
    """The options of every command that talks to a running broker."""
    options = Parser(add_help=False)
    options.add_argument(
        "--url", help="the broker's address (default $BROKER_URL, else http://127.0.0.1:8080)"
    )
    options.add_argument("--token", help="a bearer token (default $BROKER_TOKEN)")
    options.add_argument("--json", action="store_true", help="print one JSON document, for scripts")
    options.add_argument(
        "--timeout", type=_timeout, default=10.0, metavar="SECONDS", help="for each request (default 10)"
    )
    return options


def _seconds(text: str, low: float, high: float, *, low_included: bool = True) -> float:
    """A number of seconds in ``low`` … ``high``: out of range is a usage error (exit 2) here, rather
    than whatever the socket or the broker would make of it."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (low <= value <= high) or (value == low and not low_included):  # NaN fails the first
        above = f"above {low:.15g}" if not low_included else f"from {low:.15g}"
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: {above} up to {high:.15g} seconds")
    return value


def _timeout(text: str) -> float:
    return _seconds(text, 0, 86400, low_included=False)


def _wait(text: str) -> float:
    return _seconds(text, 0, 30)  # a claim's wait (§5)


def _at_least_one(text: str) -> int:
    value = _positive(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1")
    return value


def _queue_name(text: str) -> str:
    if not QUEUE_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a queue name: it must match ^[A-Za-z0-9][A-Za-z0-9._-]{{0,127}}$"
        )
    return text


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def _add_client_commands(commands: argparse._SubParsersAction[Parser]) -> None:
    """``queues …``, ``publish`` and ``consume`` (docs/cli.md); run by ``broker.commands``."""
    common = [_client_options()]
    queues = commands.add_parser("queues", help="list, create, inspect and manage queues")
    actions = queues.add_subparsers(dest="action", required=True, metavar="ACTION")

    def action(name: str, text: str) -> argparse.ArgumentParser:
        parser = actions.add_parser(name, help=text, description=text, parents=common)
        parser.set_defaults(handler=f"queues {name}")
        if name != "list":
            parser.add_argument("name", type=_queue_name, metavar="NAME", help="the queue")
        return parser

    action("list", "every queue with its depths and counters")
    create = action("create", "create a queue, or update the config of one that exists")
    create.add_argument("--config", metavar="JSON", help="any config fields as a JSON object")
    create.add_argument("--lease", metavar="DURATION", help="default lease of claims (30s)")
    create.add_argument("--max-attempts", type=_positive, metavar="N", help="0 = unlimited")
    create.add_argument(
        "--dead-letter", type=_queue_name, metavar="QUEUE", help="where dead letters go; 'none' drops them"
    )
    create.add_argument(
        "--retry-backoff", metavar="SPEC", help="nack delay: fixed:BASE or exponential:BASE[:MAX]"
    )
    create.add_argument("--max-depth", type=_positive, metavar="N", help="ready+delayed+in-flight cap")
    create.add_argument("--rate-limit", metavar="N/PER", help="e.g. 100/1s; 'none' for no limit")
    create.add_argument("--message-ttl", metavar="DURATION", help="expire messages not acked in time")
    create.add_argument("--claim-window", metavar="DURATION", help="fair-claiming window, 0 … 5s")
    create.add_argument(
        "--durable", action=argparse.BooleanOptionalAction, help="answer after fsync (default yes)"
    )
    create.add_argument("--dedup-window", metavar="DURATION", help="how long keys are remembered")
    inspect = action("inspect", "a queue's config, stats and first messages")
    inspect.add_argument("--limit", type=_positive, default=10, metavar="N", help="messages shown (10)")
    peek = action("peek", "browse messages without claiming them")
    peek.add_argument("--limit", type=_positive, default=10, metavar="N", help="messages shown (10)")
    peek.add_argument(
        "--state", choices=["ready", "delayed", "in_flight", "all"], default="ready", help="(ready)"
    )
    dlq = action("dlq", "browse the dead letters of a queue (in its dead_letter queue)")
    dlq.add_argument("--limit", type=_positive, default=10, metavar="N", help="messages shown (10)")
    redrive = action("redrive", "move a queue's dead letters back, attempts reset")
    which = redrive.add_mutually_exclusive_group(required=True)
    which.add_argument("--id", dest="ids", action="append", metavar="ID", help="a dead letter (repeat)")
    which.add_argument("--all", action="store_true", help="every dead letter that came from NAME")
    redrive.add_argument(
        "--to", type=_queue_name, metavar="QUEUE", help="another destination than where they came from"
    )
    for name, text in (
        ("purge", "remove every ready and delayed message (leases in flight finish)"),
        ("delete", "delete a queue and its messages"),
    ):
        action(name, text).add_argument("--force", action="store_true", help="required: there is no undo")

    publish = commands.add_parser("publish", help="publish messages", parents=common)
    publish.set_defaults(handler="publish")
    publish.add_argument("name", type=_queue_name, metavar="NAME", help="the queue")
    source = publish.add_mutually_exclusive_group(required=True)
    source.add_argument("--payload", metavar="JSON", help="one message's payload, as JSON")
    source.add_argument("--file", metavar="FILE", help="JSON Lines: one payload per line ('-' = stdin)")
    publish.add_argument(
        "--envelope",
        action="store_true",
        help="with --file: each line is a whole message {payload, headers, key, delay, priority}",
    )
    publish.add_argument("--key", help="idempotency key (one message)")
    publish.add_argument("--delay", metavar="DURATION", help="claimable after this long")
    publish.add_argument("--priority", type=int, metavar="N", help="higher is served first (0)")
    publish.add_argument("--header", action="append", metavar="NAME=VALUE", help="a header (repeat)")

    consume = commands.add_parser(
        "consume",
        help="claim messages, show them, then give them back (default), ack or nack them",
        parents=common,
    )
    consume.set_defaults(handler="consume")
    consume.add_argument("name", type=_queue_name, metavar="NAME", help="the queue")
    consume.add_argument(
        "--max", type=_at_least_one, default=1, metavar="N", help="at most N messages (1), in claims of 1000"
    )
    settle = consume.add_mutually_exclusive_group()
    settle.add_argument("--ack", action="store_true", help="ack them: they are done and removed")
    settle.add_argument("--nack", action="store_true", help="nack them: retried, an attempt spent")
    settle.add_argument(
        "--print-only",
        action="store_true",
        help="the default: defer them for 0 s, so they are back at once and no attempt is spent",
    )
    consume.add_argument("--wait", type=_wait, metavar="SECONDS", help="long-poll up to 30 s for a first")
    consume.add_argument("--lease", metavar="DURATION", help="(the queue's; 60s with --print-only)")
    consume.add_argument("--consumer", default="broker-cli", help="the consumer name claims carry")
    consume.add_argument("--delay", metavar="DURATION", help="with --nack: retry after this long")
    consume.add_argument("--reason", help="with --nack or --print-only: recorded in the history")


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``broker ARGV``; its exit status. The ways out that are no command's own (a usage error,
    a closed stdout, Ctrl-C) are one line on stderr here too, never a traceback."""
    arguments = sys.argv[1:] if argv is None else list(argv)
    as_json = "--json" in arguments  # known before the parsing, which may fail
    try:
        args = build_parser().parse_args(arguments)
        if args.command == "serve":
            return _serve(args)
        return _run_command(args)
    except UsageError as error:
        _report("bad_input", str(error), as_json)
        return USAGE
    except KeyboardInterrupt:
        _report("interrupted", "stopped by Ctrl-C", as_json)
        return INTERRUPTED
    except BrokenPipeError:  # `--help` into a closed pipe, or a progress bar on a closed stderr
        _abandon_stdout()
        return BROKEN_PIPE


def _run_command(args: argparse.Namespace) -> int:
    """Run a command of ``broker.commands``; a failed write to stdout ends it as docs/cli.md says."""
    from broker.commands.exits import Exit
    from broker.commands.output import StdoutFailed

    try:
        if args.command == "snapshot":
            from broker.commands.snapshots import run_snapshot

            return run_snapshot(args)
        from broker.commands import run

        return run(args)
    except StdoutFailed as error:
        _abandon_stdout()
        if error.broken_pipe:  # `broker queues peek q | head -1`: the reader has what it wanted
            return BROKEN_PIPE
        _report("output_failed", f"cannot write to stdout: {error}", args.json)
        return int(Exit.FAILED)


def _report(code: str, message: str, as_json: bool) -> None:
    from broker.commands.output import print_error

    print_error(code, message, as_json=as_json)


def _abandon_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of what is left in its buffer
    does not fail again (``Exception ignored ... BrokenPipeError``, exit 120)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):  # none (``>&-``), or no descriptor (a test's capture)
        pass


#: Below this many open files the broker warns at start (``open_files_limit``).
OPEN_FILES_ADVISED = 4096


def _log_open_files_limit(before: int, limit: int) -> None:
    import structlog

    log = structlog.get_logger("broker.server")
    raised_from = before if limit != before else None
    if limit < OPEN_FILES_ADVISED:
        log.warning(
            "open_files_limit",
            limit=limit,
            raised_from=raised_from,
            hint=f"each connection, push stream and webhook push holds a file; raise the hard limit "
            f"(LimitNOFILE=, ulimit -Hn) to at least {OPEN_FILES_ADVISED}",
        )
    else:
        log.info("open_files_limit", limit=limit, raised_from=raised_from)


def _serve(args: argparse.Namespace) -> int:
    from functools import partial

    import trio

    from broker.config import OPTIONS, ConfigError, check_exposure, load_settings
    from broker.errors import BrokerError, StorageUnavailable
    from broker.logging import configure
    from broker.runtime import raise_open_files_limit, tune_gc, tune_threads
    from broker.server import serve
    from broker.storage.segments import JournalGap, UnsupportedVersion
    from broker.storage.snapshots import SNAPSHOTS_DIR, SnapshotStoreError

    flags = {key: getattr(args, key, None) for key in OPTIONS}
    try:
        settings = load_settings(config_file=args.config, flags=flags)
        check_exposure(settings)
    except ConfigError as error:
        print(f"broker: cannot start: {error}", file=sys.stderr)
        return 2
    configure(settings.log_level)
    tune_gc()
    tune_threads()
    _log_open_files_limit(*raise_open_files_limit())
    try:
        trio.run(partial(serve, settings))
    except (OSError, BrokerError, ValueError, BaseExceptionGroup) as error:
        if _first(error, KeyboardInterrupt) is not None:  # Ctrl-C before the signals were watched
            raise KeyboardInterrupt from None  # main's one line, exit 130
        storage_error = _first(error, StorageUnavailable)
        if storage_error is not None:
            print(f"broker: cannot start: {storage_error.message}", file=sys.stderr)
            return 1
        unreadable = _first(error, JournalGap) or _first(error, UnsupportedVersion)
        if unreadable is not None:
            print(f"broker: cannot start: {unreadable}", file=sys.stderr)
            return 1
        snapshot_error = _first(error, SnapshotStoreError)
        if snapshot_error is not None:
            where = settings.data_dir / SNAPSHOTS_DIR
            print(
                f"broker: cannot start: the snapshots in {where} cannot be read: {snapshot_error}",
                file=sys.stderr,
            )
            return 1
        os_error = _first(error, OSError)
        if os_error is None:
            raise
        reason = os_error.strerror or os_error
        if os_error.filename is not None:  # a file of the data directory, not the address
            print(f"broker: cannot start: {os_error.filename}: {reason}", file=sys.stderr)
            return 1
        print(f"broker: cannot serve on {settings.host}:{settings.port}: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
