"""The KV transports' errors, below everything that raises or catches them (the engine included)."""
from __future__ import annotations

from common.errors import FailedPrecondition


class TransportUnavailable(FailedPrecondition):
    """This transport cannot move KV between these two workers; the importer tries the next one."""
