"""Suite-wide settings: every router the tests start compares its kept fleet columns with the replicas at every
decision (``Settings.check_fleet_columns``; ``router.core.fleet_columns``), so a writer that changes a replica
without ``ReplicaTable.touch`` fails the test that exercised it. Routers started as child processes inherit it."""

from __future__ import annotations

import os

os.environ.setdefault("KVROUTE_CHECK_FLEET_COLUMNS", "1")
