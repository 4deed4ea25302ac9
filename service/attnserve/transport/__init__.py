"""The data plane's transports: what carries an append, an attend or a batched step
to the step path (``step/``: parse -> rules -> plan -> answer) and its answer back.

* ``http``: ``POST .../layers/{layer}/kv``, ``.../attend`` and ``/v1/batch/attend``
  (one router);
* ``websocket``: ``/v1/stream`` (its endpoint) and the uvicorn protocol it runs on
  (the keepalive and send timeout that ``cli.py`` hands the server);
* ``frames``: the binary frame transport on a TCP port of its own (``frames_port``);
* ``shm``: the frame transport over a Unix socket (``shm_socket``), for a client on
  this host, its arrays in a memory region both map;
* ``ops``: the operations of a pipelined connection, which ``websocket`` and
  ``frames`` share (a request document checked and queued, its reply document);
* ``deps``: the FastAPI dependencies every HTTP router shares, this package's and
  the control plane's (``routes/``, which sits above this package).

The bodies' models, their checks and their OpenAPI schemas are the contract's
(``attnserve.contract``, below this package).

Imports go downward only: ``routes/`` and ``app.py`` import this package, and it
imports ``step/`` and what lies below, never ``routes/``. Within it, ``http``
imports ``deps``; ``websocket`` and ``frames`` import ``ops``; ``shm`` imports
``frames`` (its connections are frames connections) and ``ops``. This
file imports none of them: each is imported by its name.
"""
