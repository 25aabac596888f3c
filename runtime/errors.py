"""The runtime's errors, named by who is at fault, so that each surface maps each one once: kvg-generate exits 2 on
an ArtifactError or a RequestError, and kvg-serve answers a RequestError with 400, QueueFull with 429 and
ShuttingDown with 503."""

from __future__ import annotations


class ArtifactError(Exception):
    """The artifact cannot be opened or served here (missing, broken, or made for another machine); the message
    says what to change."""


class RequestError(ValueError):
    """What was asked cannot be done with this artifact: a request, or a command's options. `param`: the field at
    fault where it is one ("prompt" for the prompt, whatever a surface calls it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class QueueFull(Exception):
    """Every row is busy and the queue is full; the same request may be sent again later."""


class ShuttingDown(Exception):
    """The engine is closing and takes no more requests; another server (or this one restarted) will."""
