"""Routes the web dashboard reads besides the studies' own: parameter importances, the arrays
timeline of a study, and the cluster. Every one authenticates like the rest of ``/api/v1``."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query

from fusetune.server import cluster, importance
from fusetune.server.api.deps import PrincipalDep, SessionDep, SessionRoute, UrlDep, authenticate
from fusetune.server.api.errors import StudyId

router = APIRouter(prefix="/api/v1", dependencies=[Depends(authenticate)], route_class=SessionRoute)


@router.get("/studies/{study_id}/importances", response_model=importance.ImportancesOut, tags=["studies"])
def param_importances(
    principal: PrincipalDep,
    session: SessionDep,
    url: UrlDep,
    study_id: StudyId,
    evaluator: importance.Evaluator = Query("fanova", description="Optuna's evaluator: fANOVA, mean decrease impurity or PED-ANOVA."),
    objective: int = Query(0, ge=0, le=15, description="Which objective (0: the first)."),
) -> importance.ImportancesOut:
    """Parameter importances from Optuna's evaluators over the COMPLETE trials, cached until one more finishes."""
    return importance.param_importances(
        session, url, study_id, evaluator=evaluator, objective=objective, as_tenant=principal.tenant
    )


@router.get("/studies/{study_id}/timeline", response_model=cluster.Timeline, tags=["arrays"])
def array_timeline(
    principal: PrincipalDep,
    session: SessionDep,
    study_id: StudyId,
) -> cluster.Timeline:
    """The study's arrays per device: members with when they joined (backfill) and left, and how;
    each array's measured models·steps/s against one member trained unfused."""
    return cluster.timeline(session, study_id, as_tenant=principal.tenant)


@router.get("/cluster", response_model=cluster.ClusterOut, tags=["cluster"])
def cluster_view(
    principal: PrincipalDep,
    session: SessionDep,
) -> cluster.ClusterOut:
    """Devices by type and node, what each trains (the caller's arrays by name, others' only as busy),
    utilisation over the last five minutes, and tenants' device shares against their fair shares."""
    return cluster.cluster(session, as_tenant=principal.tenant)
