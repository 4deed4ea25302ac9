"""attnserve: attention served over HTTP, with per-session KV caches on a wgpu device.

Importing the package is cheap (no GPU, no web framework); the server is built by
:func:`attnserve.app.create_app` and started by ``attnserve serve``.
"""

from __future__ import annotations

__all__ = ["__version__"]


def _version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("attnserve")
    except (ImportError, PackageNotFoundError):  # a plain checkout
        return "0.1.0"


__version__ = _version()
