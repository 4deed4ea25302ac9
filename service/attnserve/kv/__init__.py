"""A session's KV cache: its layers as page tables over the paged KV pool (``pool.py``).

The modules, each importing only those above it in this list:

- ``config.py``: ``SessionConfig``, a session's shape and kv formats (``layer_formats``);
- ``columns.py``: a stacked step's layers as columns (``_Where``: slabs, page tables,
  signs, exact rows) and what the step's plan is made from (``_Where.basis``, for
  ``gpu/step_plan.py``), with ``OutOfRange``;
- ``layer.py``: ``LayerCache``, one layer of one session: sizing, pages and page
  tables, appends and attends, a stacked step's planning as columns and the replay of
  its plan, snapshot and fork I/O;
- ``kinds.py``: the layers of one format: ``PlainLayerCache``, ``TurboQuantLayerCache``;
- ``windowed.py``: ``WindowedLayerCache``, a TurboQuant layer that keeps sinks and a
  window exactly (issue 27), and its sizing as columns;
- ``session.py``: ``SessionKV``, all layers of one session, and ``bytes_growth``.
"""
