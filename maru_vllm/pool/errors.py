"""The pool's single exception family (the connector catches `PoolError`)."""

from __future__ import annotations


class PoolError(Exception):
    """Base class of every error the pool client or service raises."""


class PoolUnavailable(PoolError):
    """The service cannot be reached, went away, or restarted (a new incarnation)."""


class PoolTimeout(PoolUnavailable):
    """A request missed its deadline: the service may be alive but is not answering in time."""


class PoolProtocolError(PoolError):
    """The service rejected a request, or sent something this client does not understand."""

    def __init__(self, message: str, code: str = "protocol") -> None:
        super().__init__(message)
        self.code = code


class InvalidArgument(PoolError, ValueError):
    """A caller-side argument is out of range (key too long, negative size, ...)."""
