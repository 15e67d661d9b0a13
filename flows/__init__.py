"""Prefect flows, their parameter model (the UI form), and the command-line interface.

Importing this package sets the project's Prefect defaults, unless the environment sets them, before Prefect is
imported (it reads its settings then), so every way a run starts here gets them: the CLI, `serve`, a Python call of
the flow. The temporary server of the ephemeral API gets 120 s to start (Prefect's 20 s expire on a loaded
machine); its telemetry, which writes to the same SQLite file as the run and prints `database is locked` tracebacks
when they collide, is off; the library's own log lines (a long solve's progress) go to the run's logs.
"""

import os

PREFECT_DEFAULTS = {
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_EXTRA_LOGGERS": "influence_core",
}
for _name, _value in PREFECT_DEFAULTS.items():
    os.environ.setdefault(_name, _value)
