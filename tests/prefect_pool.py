"""The `mega-process` work pool infra/prefect.yaml deploys to, on the session's Prefect server."""

from __future__ import annotations

WORK_POOL = "mega-process"


def ensure_work_pool() -> None:
    """Create it unless another test of this session (test_flow.py, test_recovery.py, in either
    order) already did."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(
                WorkPoolCreate(
                    name=WORK_POOL,
                    type="process",
                    base_job_template=ProcessWorker.get_default_base_job_template(),
                )
            )
        except ObjectAlreadyExists:
            pass
