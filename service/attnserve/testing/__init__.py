"""Test-only helpers, not part of the server's run time (nothing in ``attnserve``
outside this package imports it): :mod:`attnserve.testing.reference`, the float64
numpy oracles that tests, benchmarks, the soak test and the examples check the
kernels and the service against."""
