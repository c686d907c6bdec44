"""The CLI's errors: one line of text and the exit code that goes with it.

Exit codes follow sysexits(3) so they stay apart from the small codes a
remote command returns through `aenv exec`: 64 bad arguments, 66 not found,
69 server unreachable, 76 unexpected answer, 77 authentication, 78 no
credentials configured, 1 anything else the server refused.
"""

from __future__ import annotations

EXIT_ERROR = 1
EXIT_USAGE = 64
EXIT_NOT_FOUND = 66
EXIT_UNREACHABLE = 69
EXIT_PROTOCOL = 76
EXIT_AUTH = 77
EXIT_CONFIG = 78


class CliError(Exception):
    """An error the CLI reports as one line on stderr and exits with."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UsageError(CliError):
    exit_code = EXIT_USAGE


class NotFound(CliError):
    exit_code = EXIT_NOT_FOUND


class Unreachable(CliError):
    exit_code = EXIT_UNREACHABLE


class ProtocolViolation(CliError):
    exit_code = EXIT_PROTOCOL


class AuthFailed(CliError):
    exit_code = EXIT_AUTH


class NotConfigured(CliError):
    exit_code = EXIT_CONFIG


class ServerError(CliError):
    """The server answered with an error status (409, 5xx, 501 not supported, ...)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def from_status(status: int, message: str) -> CliError:
    """The CliError for an HTTP error answer."""
    if status == 401 or status == 403:
        return AuthFailed(message)
    if status == 404:
        return NotFound(message)
    if status == 400:
        return UsageError(message)
    return ServerError(message, status)
