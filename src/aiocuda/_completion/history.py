"""How long waits take: the prediction knobs and each stream's wait history.

The completion engine (:mod:`.engine`) decides from a stream's :class:`WaitHistory`
whether a wait spins, polls, or sleeps on its doorbell until shortly before its
predicted end.
"""

from __future__ import annotations

__all__ = ["MAX_POLL_SHARE", "POLL_WINDOW", "PREDICTION_LEAD", "SPIN_MAX", "WaitHistory"]

SPIN_MAX = 50e-6
"""Longest spin of a lone waiter (seconds)."""

POLL_WINDOW = 0.002
"""Seconds a wait of unknown or short expected length polls before its doorbell rings."""

PREDICTION_LEAD = 0.001
"""Seconds before the predicted end at which a long wait starts polling: covers the
waker's own wake-up latency and the hop to the loop."""

MAX_POLL_SHARE = 0.04
"""A predicted wait polls for at most this share of its expected length (or
:data:`POLL_WINDOW`, if longer): bounds the CPU a wrong prediction costs."""


class WaitHistory:
    """How long waits on one stream took: an exponentially weighted mean of the
    duration and of its absolute deviation (recent waits weigh most).

    A wait far shorter than expected restarts the history: the stream's work has
    changed, and sleeping through the next waits on the old expectation would cost each
    of them a doorbell's latency. (A longer wait needs no such care: the doorbell wakes
    it on time, and the mean moves up.)
    """

    __slots__ = ("expected", "spread")

    WEIGHT = 0.25
    RESTART_BELOW = 0.25
    """A wait shorter than this share of the expected duration restarts the history."""

    def __init__(self, duration: float) -> None:
        self.expected = duration
        self.spread = duration / 2

    def add(self, duration: float) -> None:
        if duration < self.RESTART_BELOW * self.expected:
            self.expected, self.spread = duration, duration / 2
            return
        error = duration - self.expected
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
