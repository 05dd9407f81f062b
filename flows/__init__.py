"""Prefect flows (``pretrain``, ``recover``): the only package that imports Prefect's flow API.

Importing this package sets two defaults for a Prefect server the process starts itself (a local
run without ``PREFECT_API_URL`` gets Prefect's temporary server), before Prefect is imported;
an explicit setting in the environment wins:

* ``PREFECT_SERVER_ANALYTICS_ENABLED=false``: the temporary server's telemetry service writes its
  session into the server's new SQLite database while the first flow run writes there too (on a
  fresh machine the first run printed a ``sqlite3.OperationalError: database is locked`` traceback
  from ``send_telemetry_heartbeat``), then posts to prefect.io, which logs an ERROR on a machine
  without internet access. A server started with ``prefect server start`` is not affected.
* ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120``: on a fresh machine the temporary
  server first creates and migrates its database; Prefect's 20 s default ran out on 2 busy cores
  ("Timed out while attempting to connect to ephemeral Prefect API server").
"""

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
