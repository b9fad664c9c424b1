"""The command line behind ``python -m aiocuda`` and the ``aiocuda`` command.

* ``main.py``  -- the parser, exit codes and what every command shares: expected
  failures as one line, Ctrl-C, a closed output pipe, the simulator's warning;
* ``info.py``  -- ``info``: the backend and every device (``--json`` for programs);
* ``demo.py``  -- ``demo``: the multi-stream, multi-device pipeline;
* ``bench.py`` -- ``bench``: the benchmark programs of a source checkout.
"""
