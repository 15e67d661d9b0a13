"""The project's Prefect defaults hold for every way a run starts (importing `flows` sets them before Prefect reads
its settings), and the environment still wins."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from flows import PREFECT_DEFAULTS

READ = (
    "import json, flows.influence_run; from prefect.settings import get_current_settings; s = get_current_settings();"
    "print(json.dumps([s.server.ephemeral.startup_timeout_seconds, s.server.analytics_enabled, s.logging.extra_loggers]))"
)


def settings_in_a_new_process(**env: str) -> list:
    clean = {k: v for k, v in os.environ.items() if k not in PREFECT_DEFAULTS}
    done = subprocess.run([sys.executable, "-c", READ], env={**clean, **env}, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_flow_applies_the_project_defaults_unless_the_environment_sets_them() -> None:
    timeout, analytics, loggers = settings_in_a_new_process(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="45")
    assert analytics is False  # Prefect's own default is on
    assert "influence_core" in (loggers if isinstance(loggers, list) else [loggers])
    assert timeout == 45  # the environment wins over the project's 120 (Prefect's own is 20)
    assert PREFECT_DEFAULTS["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] == "120"
