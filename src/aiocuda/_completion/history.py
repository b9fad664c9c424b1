"""How long waits take: the prediction knobs and the wait history of a stream and place.

The completion engine (:mod:`.engine`) keeps a :class:`WaitHistory` per stream and
place in the code that awaits, and decides from it whether a wait spins, is polled, or
is parked until shortly before its predicted end.
"""

from __future__ import annotations

__all__ = ["MAX_POLL_SHARE", "POLL_WINDOW", "PREDICTION_LEAD", "SPIN_MAX", "WaitHistory"]

# Why predict at all: on the virtual machines GPUs are rented in, each sleeping thread a
# wake-up passes through (the driver's callback thread, the waker, the loop) adds about
# 100 us, so a doorbell resumes a task 150-450 us after the GPU finished, where polling
# takes 5 us (H100, 2026). Spinning up to 50 us makes tiny operations as fast as a
# blocking synchronize while blocking the loop for less than a scheduling quantum.

SPIN_MAX = 50e-6
"""Longest spin of a lone waiter (seconds)."""

POLL_WINDOW = 0.002
"""Seconds a wait of unknown or short expected length is polled before it is overdue."""

PREDICTION_LEAD = 0.001
"""Seconds before the predicted end at which a parked wait starts polling: covers the
lateness of a loop's timer (1 ms resolution) or of the waker's hop to the loop."""

MAX_POLL_SHARE = 0.04
"""A predicted wait polls for at most this share of its expected length (or
:data:`POLL_WINDOW`, if longer): bounds the CPU a wrong prediction costs."""


class WaitHistory:
    """How long waits took: an exponentially weighted mean of the duration and of its
    absolute deviation (recent waits weigh most).

    A wait far shorter than expected restarts the history: the work has changed, and
    parking the next waits on the old expectation would wake each of them late. A wait
    far longer than expected counts as only :attr:`OUTLIER` spreads (or a quarter of the
    expectation) longer: a loop that stalled, or a GPU shared for a moment, must not park
    the next waits past their end.
    (Work that got longer for good is still learnt within a few waits, the spread growing
    with each; meanwhile its waits are overdue and queried until they end.)
    """

    __slots__ = ("expected", "spread")

    WEIGHT = 0.25
    RESTART_BELOW = 0.25
    """A wait shorter than this share of the expected duration restarts the history."""
    OUTLIER = 4.0
    """A wait is learnt as at most this many spreads (or a quarter of the expected
    duration, if more) longer than expected."""

    def __init__(self, duration: float) -> None:
        self.expected = duration
        self.spread = duration / 2

    def add(self, duration: float) -> None:
        """Learn one wait's duration (seconds)."""
        if duration < self.RESTART_BELOW * self.expected:
            self.expected, self.spread = duration, duration / 2
            return
        error = min(duration - self.expected, max(self.OUTLIER * self.spread, self.expected / 4))
        self.expected += self.WEIGHT * error
        self.spread += self.WEIGHT * (abs(error) - self.spread)

    def poll_window(self) -> tuple[float, float]:
        """``(start, end)`` of the polling window, in seconds after the wait began."""
        margin = 2 * self.spread
        start = max(0.0, self.expected - margin - PREDICTION_LEAD)
        end = self.expected + margin + PREDICTION_LEAD
        cap = max(POLL_WINDOW, MAX_POLL_SHARE * self.expected)
        if end - start > cap:  # too uncertain to poll it all: the part around the expectation
            start = max(0.0, self.expected - cap / 2)
            end = start + cap
        return start, end
