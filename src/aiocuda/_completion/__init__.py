"""The completion layer: "this point in a stream has finished" -> wake the waiting task.

:func:`.engine.current_engine` is the completion engine of the backend in use. Its
parts: each loop's poller (:mod:`.poller`) and adapter (:mod:`.loops`), the waker thread
behind the doorbells (:mod:`.waker`), wait histories (:mod:`.history`), the signal
streams doorbells ring on (:mod:`.signals`), the event pool (:mod:`.event_pool`) and the
thread that makes both ahead of time (:mod:`.reserve`).
"""
