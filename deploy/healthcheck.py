#!/usr/bin/env python3
"""Container health check: exit 0 when the service answers 200 on /readyz, else 1.

    attnserve-healthcheck [URL]     default http://127.0.0.1:$ATTNSERVE_PORT/readyz

Standard library only (the image has no curl), no proxy from the environment,
a 3 s timeout (ATTNSERVE_HEALTHCHECK_TIMEOUT_S). The image's HEALTHCHECK runs it.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main(argv: list[str]) -> int:
    port = os.environ.get("ATTNSERVE_PORT", "8421")
    url = argv[1] if len(argv) > 1 else f"http://127.0.0.1:{port}/readyz"
    timeout = float(os.environ.get("ATTNSERVE_HEALTHCHECK_TIMEOUT_S", "3"))
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (OSError, ValueError) as exc:
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"unhealthy: {url} answered {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
