"""KV sessions: a finished context_only request's blocks, pinned until pulled, released or expired.

The table is touched from two threads: the engine thread creates sessions and expires them, while exports
(TensorStore.Pull) lease them and Releases end them from the event loop's thread, without waiting for a
model step. `lock` guards the table, every session's `leases` and the sessions released while leased; it is
never held while blocks are freed, so it nests inside no other lock. A method that ends a session hands back
the block ids nobody holds any more, for the caller to free (the block manager has a lock of its own): each
id is handed back exactly once, by the release, the expiry or the end of the last lease.
"""
from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Sequence

from common.errors import InvalidRequest, NotFound, SessionExpired


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
    """Owns pinned sessions and their leases; the engine frees the block ids that `release`, `end_lease` and
    `pop_expired` hand back."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self.sessions: dict[str, KvSession] = {}
        self.num_expired = 0
        self.lock = threading.Lock()
        self._recently_expired: dict[str, float] = {}
        self._released_leased: dict[str, KvSession] = {}  # released while an export read them: freed by end_lease

    def create(self, request_id: str, block_ids: list[int], num_tokens: int, first_token: int,
               block_hashes: list[int]) -> KvSession:
        now = time.monotonic()
        session = KvSession(
            session_id=uuid.uuid4().hex, request_id=request_id, block_ids=list(block_ids), num_tokens=num_tokens,
            first_token=first_token, expires_at=now + self.ttl_s, expires_at_unix=time.time() + self.ttl_s,
            block_hashes=list(block_hashes),
        )
        with self.lock:
            self.sessions[session.session_id] = session
        return session

    def get(self, session_id: str) -> KvSession:
        with self.lock:
            return self._get(session_id)

    def _get(self, session_id: str) -> KvSession:
        session = self.sessions.get(session_id)
        if session is None:
            if session_id in self._recently_expired:
                raise SessionExpired(f"KV session {session_id} expired after its TTL of {self.ttl_s:g}s")
            raise NotFound(f"no KV session {session_id} (never created, or already released)")
        return session

    def lease(self, session_id: str, block_ids: Sequence[int] = ()) -> list[int]:
        """Start an export of the session's blocks (or of `block_ids`, some of them): they stay out of the pool,
        through a release or the TTL, until `end_lease`."""
        with self.lock:
            session = self._get(session_id)
            if block_ids:
                foreign = sorted(set(block_ids) - set(session.block_ids))
                if foreign:
                    raise InvalidRequest(f"block ids {foreign[:8]} are not in KV session {session_id}")
            session.leases += 1
            return list(block_ids) if block_ids else list(session.block_ids)

    def end_lease(self, session_id: str) -> list[int]:
        """End one export; the blocks to free now (those of a session released meanwhile, at its last lease)."""
        with self.lock:
            session = self.sessions.get(session_id) or self._released_leased.get(session_id)
            if session is None or session.leases <= 0:
                return []
            session.leases -= 1
            if session.leases or self._released_leased.pop(session_id, None) is None:
                return []
            return session.block_ids

    def release(self, session_id: str) -> list[int]:
        """Forget the session; the blocks to free now ([] while an export still reads them: its end_lease
        hands them back). NotFound / SessionExpired when it is not held."""
        with self.lock:
            session = self._get(session_id)
            del self.sessions[session_id]
            if session.leases:
                self._released_leased[session_id] = session
                return []
            return session.block_ids

    def ids_of(self, request_id: str | None) -> list[str]:
        """The sessions one request made (None: every session)."""
        with self.lock:
            return [s.session_id for s in self.sessions.values() if request_id in (None, s.request_id)]

    def held(self) -> tuple[int, int]:
        """How many sessions are held, and their blocks."""
        with self.lock:
            return len(self.sessions), sum(len(s.block_ids) for s in self.sessions.values())

    @property
    def num_released_leased(self) -> int:
        return len(self._released_leased)

    def pop_expired(self, now: float | None = None) -> list[KvSession]:
        """Sessions past their TTL; one being exported now waits for its export to end."""
        now = time.monotonic() if now is None else now
        with self.lock:
            expired = [s for s in self.sessions.values() if s.expires_at <= now and not s.leases]
            for s in expired:
                del self.sessions[s.session_id]
                self._recently_expired[s.session_id] = now
            self.num_expired += len(expired)
            # Remember expiries for one more TTL so a late pull hears "expired", not "unknown".
            self._recently_expired = {k: t for k, t in self._recently_expired.items() if now - t < self.ttl_s}
        return expired
