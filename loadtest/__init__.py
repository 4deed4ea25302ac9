"""The load test: ``attnserve-loadtest --help`` where the project is installed (this
package is ``attnserve.loadtest`` there), ``python loadtest/loadtest.py --help`` from
a checkout (the package ``loadtest``): loadtest.py (the command), config, driver,
report, prometheus."""
