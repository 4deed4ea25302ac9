"""The load test: ``python loadtest/loadtest.py --help`` (config, driver, report)."""
