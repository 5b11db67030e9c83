"""Typed errors raised by the library; services map them to gRPC status codes in one place."""


class DisaggError(Exception):
    """Base class: every error the library raises on purpose."""


class InvalidRequest(DisaggError):
    """The request itself is wrong (maps to INVALID_ARGUMENT)."""


class InvalidConfig(DisaggError):
    """A configuration value is out of range; the message names the flag."""


class NotFound(DisaggError):
    """Unknown model, session or handle (maps to NOT_FOUND)."""


class SessionExpired(NotFound):
    """A KV session or tensor handle outlived its TTL."""


class LayoutMismatch(DisaggError):
    """Exported KV does not fit the importer's cache (maps to FAILED_PRECONDITION)."""


class HandoffMismatch(DisaggError):
    """What one phase handed the next does not hold there (a first token the request's grammar refuses): a fault of
    the serving side, never the client's (maps to INTERNAL)."""


class FailedPrecondition(DisaggError):
    """The deployment cannot serve this kind of request (e.g. images without an encode worker)."""


class ResourceExhausted(DisaggError):
    """A queue or the KV pool is full (maps to RESOURCE_EXHAUSTED)."""


class Unavailable(DisaggError):
    """No healthy worker can take the request, or the service is draining (maps to UNAVAILABLE)."""


class DeadlineExceeded(DisaggError):
    """The request's deadline passed before it finished (maps to DEADLINE_EXCEEDED)."""
