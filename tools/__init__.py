"""Helpers shared by the repository's tools (bench/, loadtest/, soak/) and tests/.

Nothing here is installed: a script run from a checkout puts the repository root
on ``sys.path`` (two lines at the top of each script) and imports
``tools.common``; tests/conftest.py does the same for the test suite.
"""
