"""tests/image: the API checked against a running attnserve over HTTP only, the way
deploy/test-image.sh runs it against the container image built with podman.

The target comes from the environment (deploy/test-image.sh sets it):

  ATTNSERVE_TEST_URL                the service (one container), or a router in front of replicas
  ATTNSERVE_TEST_INSTANCE           optional: the X-Attnserve-Instance every answer must carry
  ATTNSERVE_TEST_ADAPTER            optional: part of the adapter name /v1/info must report
  ATTNSERVE_TEST_REPLICAS           when the URL is a router: ``name=url,name=url`` (each replica
                                    directly; the names are their ATTNSERVE_INSTANCE_NAMEs)
  ATTNSERVE_TEST_ROUTER_ACCESS_LOG  the router's access log (log_format attnserve)
  ATTNSERVE_TEST_STOP_REPLICA       a command that stops one replica, ``{name}`` replaced by its
                                    name (``podman stop -t 30 {name}``); the last router test uses it

Without ATTNSERVE_TEST_URL, test_api_contract.py is skipped as a whole, and without
ATTNSERVE_TEST_REPLICAS so is test_router_contract.py; each says why. A module whose
target IS given never skips: any skip in it is turned into a failure, so a run
against a container cannot pass by skipping.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from image_helpers import TARGET, Api


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and getattr(item.module, "RUNS_HERE", False) and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped while testing {TARGET.url}, which is a failure here: {reason}"


@pytest.fixture(scope="module")
def target():
    return TARGET


@pytest.fixture(scope="module")
def api(target) -> Iterator[Api]:
    if target.routed:
        expect = set(target.replicas)
    else:
        expect = target.instance
    a = Api(target.url, expect_instance=expect)
    yield a
    a.close()
