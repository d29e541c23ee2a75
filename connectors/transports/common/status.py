"""A transfer's state as `poll` reports it: pending, done, or failed with a reason."""

from __future__ import annotations

import msgspec

PENDING, DONE, FAILED = "pending", "done", "failed"


class TransferStatus(msgspec.Struct, frozen=True):
    state: str  # PENDING, DONE or FAILED
    reason: str | None = None  # why it failed

    @property
    def final(self) -> bool:
        return self.state != PENDING


STATUS_PENDING = TransferStatus(PENDING)
STATUS_DONE = TransferStatus(DONE)


def failed(reason: str) -> TransferStatus:
    return TransferStatus(FAILED, reason)
