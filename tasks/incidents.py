"""Incidents in Prefect: ``run_training``'s ``on_incident`` for the tasks that train (train,
restart-run). Each incident is a Prefect event (automations can match ``mega.incident.*``) and a
markdown artifact (the table of mega.stability.incident); its recovery is a second event and a
new version of the same artifact."""

from __future__ import annotations

import re
from pathlib import Path

from prefect.artifacts import create_markdown_artifact
from prefect.events import emit_event


def event_name(incident: dict) -> str:
    """``mega.incident.<kind>`` when filed, ``mega.recovery.<kind>`` when the run trains again."""
    return f"mega.{'incident' if incident['stage'] == 'detected' else 'recovery'}.{incident['kind']}"


def artifact_key(incident: dict) -> str:
    """One key per incident of a run (Prefect keys: lowercase letters, digits, dashes)."""
    run = re.sub(r"[^a-z0-9-]+", "-", Path(incident["run_dir"]).name.lower()).strip("-")[:40] or "run"
    stem = re.sub(r"[^a-z0-9-]+", "-", Path(incident["file"]).stem.lower())
    return f"incident-{run}-{stem}"


def publish_incident(incident: dict) -> None:
    """Emit the incident's event and write its markdown artifact (in the calling task's run)."""
    run_dir = Path(incident["run_dir"])
    emit_event(
        event=event_name(incident),
        resource={
            "prefect.resource.id": f"mega.run.{run_dir.name}",
            "prefect.resource.name": run_dir.name,
            "mega.run-dir": str(run_dir),
        },
        payload={**incident["brief"], "summary": incident["summary"], "stage": incident["stage"]},
    )
    create_markdown_artifact(
        key=artifact_key(incident),
        markdown=incident["markdown"],
        description=f"{incident['kind']} ({incident['stage']}): {incident['summary'][:200]}",
    )
