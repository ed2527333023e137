"""The `dsv4-drift` command line (one verb per job: `main`, `commands/`) and the pytest plugin.

The console script is `harness.cli.main:main`; `python -m harness.cli` does the same. This package's
`__init__` imports nothing, so the pytest plugin (`harness.cli.pytest_plugin`) stays light until used.
"""
