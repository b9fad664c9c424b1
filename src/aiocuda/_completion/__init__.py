"""The completion layer: "this point in a stream has finished" -> wake the waiting task.

:func:`.engine.current_engine` is the completion engine of the backend in use; loop
adapters (:mod:`.loops`), wait histories (:mod:`.history`) and signal streams
(:mod:`.signals`) are its parts.
"""
