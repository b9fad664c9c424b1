"""The executor's private half: each device's streams, one chunk's run, the pipeline that
admits chunks with back-pressure, and placement on devices."""
