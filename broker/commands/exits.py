"""The exit statuses of the client commands, and the error a command raises to stop with one.

Scripts may rely on these (docs/cli.md lists them):

====  ==========================================================================================
 0    done
 1    the broker refused or failed the request (``conflict``, ``queue_full``,
      ``storage_unavailable``, ``internal_error``, …)
 2    usage or bad input: a bad flag or value, JSON that does not parse, ``purge``/``delete``
      without ``--force``, and the broker's own ``invalid_request`` / ``payload_too_large`` /
      ``unsupported_media_type``
 3    the broker cannot be reached (connection refused, timeout, a URL that is not one)
 4    not found: ``queue_not_found``, ``message_not_found``, ``not_found``
 5    refused for the token: ``unauthorized``, ``forbidden``
====  ==========================================================================================

``broker.cli.main`` adds two of its own: 130 for Ctrl-C, and 141 when stdout's reader went away.
"""

from __future__ import annotations

import enum


class Exit(enum.IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    UNREACHABLE = 3
    NOT_FOUND = 4
    DENIED = 5


#: The broker's error codes (§2) whose exit status is not ``FAILED``.
EXIT_BY_CODE: dict[str, Exit] = {
    "invalid_request": Exit.USAGE,
    "payload_too_large": Exit.USAGE,
    "unsupported_media_type": Exit.USAGE,
    "not_found": Exit.NOT_FOUND,
    "queue_not_found": Exit.NOT_FOUND,
    "message_not_found": Exit.NOT_FOUND,
    "unauthorized": Exit.DENIED,
    "forbidden": Exit.DENIED,
}


def exit_for(code: str) -> Exit:
    return EXIT_BY_CODE.get(code, Exit.FAILED)


class CommandError(Exception):
    """A command stops: ``code`` is the contract's error code, or one of the CLI's own (``bad_input``,
    ``unreachable``, ``force_required``, ``no_dead_letter_queue``)."""

    def __init__(self, code: str, message: str, exit_status: Exit) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.exit_status = exit_status


def bad_input(message: str) -> CommandError:
    return CommandError("bad_input", message, Exit.USAGE)
