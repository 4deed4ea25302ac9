"""Every append and attend, whatever carries it, as a step through five stages,
one module each, in the order a request walks them:

1. ``parse``: request documents into steps: one layer's operations on distinct
   sessions as columns (a single operation is a step of one);
2. ``rules``: each rule once, as columns, naming a refused item's problem; the
   reservation of what passes (``Store.step_lengths``, ``Store.reserve_step``);
3. and 4. ``plan``: the GPU job of each step (``Engine.plan_stacked``), queued as
   one submission, and awaited;
5. ``answer``: the answer document, in the form the request came in.

The transports (``transport/``: ``http.py``, and ``ops.py`` for the WebSocket
stream and the frame transport) call these and nothing else of the path.
"""
