"""When a split kernel's calls run on the calling thread alone for a while: after splits whose awake helpers took no
part, or fell behind (descheduled: their CPU busy with another process, where such splits cost more than the call
alone, and a helper that spins between calls takes CPU time from the caller too).

A back-off runs IDLE_HELPER_CALLS calls alone, twice as many at each back-off after another up to IDLE_HELPER_MOST,
back to the least once helpers keep up again. A helper just woken from its sleep is marked awake before its CPU runs
it: the IDLE_HELPER_GRACE splits after a wake may miss it.
"""

from __future__ import annotations

IDLE_HELPER_CALLS, IDLE_HELPER_MOST, IDLE_HELPER_GRACE = 64, 4096, 2


class HelperBackoff:
    """One split kernel's back-off (product_attention.ProductAttention, segment_chain's split chains), counted in the
    pieces its splits share (a node's call, a chain's row): a miss is a debt of ``miss_pieces``, each piece the
    helpers kept up with pays one back; the calls back off once the debt passes ``tolerated_pieces`` (a virtual CPU
    the host holds now and then misses a row in hundreds on a quiet machine, one beside a CPU-bound process every
    few dozen), and the next back-off is the least again after ``recovery_pieces`` kept since the last. The
    defaults back off at each miss."""

    def __init__(self, miss_pieces: int = 1, tolerated_pieces: int = 0, recovery_pieces: int = 1):
        self.miss_pieces, self.tolerated_pieces, self.recovery_pieces = miss_pieces, tolerated_pieces, \
            recovery_pieces
        self.alone = 0  # calls left to run on the calling thread
        self.backoff = IDLE_HELPER_CALLS  # the next back-off's calls
        self.grace = 0  # splits after a helper's wake that may miss it
        self.debt = 0  # the misses' pieces not paid back
        self.kept = 0  # pieces kept up with since the last back-off

    def runs_alone(self) -> bool:
        """Whether this call runs on the calling thread (a back-off's calls left), counted."""
        if self.alone <= 0:
            return False
        self.alone -= 1
        return True

    def woken(self) -> None:
        """A split woke a sleeping helper."""
        self.grace = IDLE_HELPER_GRACE

    def took_part(self, pieces: int = 1) -> None:
        """A split's helpers took part in ``pieces`` pieces and kept up."""
        self.debt = max(0, self.debt - pieces)
        self.kept += pieces
        if self.kept >= self.recovery_pieces:
            self.backoff = IDLE_HELPER_CALLS

    def missed(self) -> None:
        """A split's awake helpers took no part in a piece, or fell behind."""
        if self.grace > 0:
            self.grace -= 1
            return
        self.debt += self.miss_pieces
        if self.debt > self.tolerated_pieces:
            self.alone, self.backoff = self.backoff, min(2 * self.backoff, IDLE_HELPER_MOST)
            self.debt = self.kept = 0
