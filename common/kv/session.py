"""KV sessions: a finished context_only request's blocks, pinned until pulled, released or expired."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from common.errors import NotFound, SessionExpired


@dataclass
class KvSession:
    session_id: str
    request_id: str
    block_ids: list[int]
    num_tokens: int
    first_token: int
    expires_at: float  # time.monotonic() deadline
    expires_at_unix: float  # the same deadline on the wall clock, for the handoff metadata
    block_hashes: list[int] = field(default_factory=list)
    # Exports in flight (a gather still reading the blocks): the blocks stay out of the pool until 0.
    leases: int = 0
    epoch: int | None = None  # its blocks' epoch sum when pinned, where the exporter fences one-sided reads


class KvSessionTable:
    """Owns pinned sessions; the engine frees their blocks through `release` / `pop_expired`."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self.sessions: dict[str, KvSession] = {}
        self.num_expired = 0
        self._recently_expired: dict[str, float] = {}

    def create(self, request_id: str, block_ids: list[int], num_tokens: int, first_token: int,
               block_hashes: list[int]) -> KvSession:
        now = time.monotonic()
        session = KvSession(
            session_id=uuid.uuid4().hex, request_id=request_id, block_ids=list(block_ids), num_tokens=num_tokens,
            first_token=first_token, expires_at=now + self.ttl_s, expires_at_unix=time.time() + self.ttl_s,
            block_hashes=list(block_hashes),
        )
        self.sessions[session.session_id] = session
        return session

    def get(self, session_id: str) -> KvSession:
        session = self.sessions.get(session_id)
        if session is None:
            if session_id in self._recently_expired:
                raise SessionExpired(f"KV session {session_id} expired after its TTL of {self.ttl_s:g}s")
            raise NotFound(f"no KV session {session_id} (never created, or already released)")
        return session

    def release(self, session_id: str) -> KvSession:
        session = self.get(session_id)
        del self.sessions[session_id]
        return session

    def pop_expired(self, now: float | None = None) -> list[KvSession]:
        """Sessions past their TTL; one being exported now waits for its export to end."""
        now = time.monotonic() if now is None else now
        expired = [s for s in self.sessions.values() if s.expires_at <= now and not s.leases]
        for s in expired:
            del self.sessions[s.session_id]
            self._recently_expired[s.session_id] = now
        self.num_expired += len(expired)
        # Remember expiries for one more TTL so a late pull hears "expired", not "unknown".
        self._recently_expired = {k: t for k, t in self._recently_expired.items() if now - t < self.ttl_s}
        return expired
