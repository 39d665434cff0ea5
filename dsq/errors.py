"""One error family for user mistakes: printed as one line with the next step, exit code 1."""

from __future__ import annotations


class DsqError(Exception):
    """A problem the user can fix. `hint` says what to do next."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        msg = self.message.rstrip(".")
        if not self.hint:
            return msg
        return f"{msg}. {self.hint[:1].upper()}{self.hint[1:]}"


class Terminated(KeyboardInterrupt):
    """SIGTERM, stopping a command as Ctrl-C does (what it kept is said the same way)."""


class ModelNotFound(DsqError):
    pass


class UnsupportedModel(DsqError):
    pass


class BadModelFile(DsqError):
    pass


class OutputExists(DsqError):
    pass


class MissingDependency(DsqError):
    pass


class BackendError(DsqError):
    pass


class DiskFull(DsqError):
    """Not enough free space for what a command writes."""
