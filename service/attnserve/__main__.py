"""``python -m attnserve serve ...``: the same as the ``attnserve`` command."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
