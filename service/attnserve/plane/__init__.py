"""The compiled data plane (issue 53; docs/architecture.md, "Next: an explicit
step, run by a compiled data plane"): C modules below the transports and the
step registry, which both drive them.

* ``_callframe`` (``callframe.c``, its binding ``_callframe.c``): the binary
  layer-call frame's parser, and the table of open steps with their per-token
  bookkeeping (the one owner of which layers a step's token has called).
"""
