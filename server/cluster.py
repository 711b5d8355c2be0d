"""What the dashboard's arrays and cluster views read: arrays on a timeline per device, and
the devices, what they run and the tenants' shares.

Both are read from fusetune's tables only (``ft_arrays``, ``ft_array_members``, ``ft_trials``,
``ft_workers``, ``ft_throughput``, ``ft_tenants``), in a few queries whatever the study's size.

Scoping is the service layer's: a tenant sees its own studies' arrays; devices are shared by
every tenant, so a tenant sees every device, but of another tenant's work only that the
device is busy, and of the other tenants only their sum.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Literal

from pydantic import BaseModel, Field
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from fusetune.server.db import Array, ArrayMember, ArrayState, Study, Tenant, Throughput, Trial, TrialState, Worker
from fusetune.server.service import _study

#: A member whose trial joined its array later than this after the array started joined it
#: by backfill (the first members are placed in the transaction that creates the array).
BACKFILL_AFTER = timedelta(milliseconds=500)

#: The window a device's utilisation is measured over (the share of it that it ran arrays).
UTILISATION_WINDOW = timedelta(minutes=5)


def _utc(t: datetime) -> datetime:
    """A timestamp that is never None (a row's ``created_at``), aware, in UTC."""
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t


def _aware(t: datetime | None) -> datetime | None:
    """SQLite hands datetimes back naive; they were written in UTC."""
    if t is not None and t.tzinfo is None:
        return t.replace(tzinfo=UTC)
    return t


class MemberSpan(BaseModel):
    trial_id: int
    number: int
    slot: int
    joined_at: datetime | None = Field(description="When it joined (its trial's start while in this array).")
    left_at: datetime | None = Field(description="When it left: its trial's end, or the array's end; null while it trains.")
    backfill: bool = Field(description="It joined a running array, into a slot an ended member freed.")
    end: Literal["RUNNING", "COMPLETE", "PRUNED", "FAIL", "MOVED"] = Field(
        description="How it left: its trial's end state, or MOVED when it left preempted or its array "
        "failed and it resumed (or waits to resume) elsewhere."
    )
    value: float | None


class ArraySpan(BaseModel):
    id: int
    study_id: int
    worker: str | None
    device_type: str | None
    node: str | None
    state: ArrayState
    signature: str
    created_at: datetime
    completed_at: datetime | None
    epochs_done: int
    models_steps_per_s: float | None = Field(description="Measured models·steps/s of the whole array.")
    unfused_models_steps_per_s: float | None = Field(
        description="One member trained alone on this device type (the B = 1 point measured for the signature)."
    )
    speedup: float | None = Field(description="models_steps_per_s over the unfused speed.")
    members: list[MemberSpan]
    error: str | None


class Timeline(BaseModel):
    study_id: int
    now: datetime
    devices: list[str] = Field(description="Workers that ran the study's arrays, in order of first use.")
    arrays: list[ArraySpan]


def timeline(session: Session, study_id: int, *, as_tenant: str | None = None) -> Timeline:
    """The study's arrays on a timeline per device, with each member's span."""
    _study(session, study_id, as_tenant)
    arrays = session.execute(
        select(Array, Worker).outerjoin(Worker, Array.worker_id == Worker.id).where(Array.study_id == study_id).order_by(Array.id)
    ).all()
    rows = session.execute(
        select(ArrayMember.array_id, ArrayMember.slot, Trial)
        .join(Trial, ArrayMember.trial_id == Trial.id)
        .join(Array, ArrayMember.array_id == Array.id)
        .where(Array.study_id == study_id)
        .order_by(ArrayMember.array_id, ArrayMember.slot)
    ).all()
    solo = {
        (r.signature, r.device_type): r.models_steps_per_s
        for r in session.scalars(select(Throughput).where(Throughput.members == 1))
    }
    members: dict[int, list[MemberSpan]] = {}
    ends = {a.id: _aware(a.completed_at) for a, _ in arrays}
    starts = {a.id: _utc(a.created_at) for a, _ in arrays}
    for array_id, slot, trial in rows:
        here = trial.array_id == array_id
        started, completed = _aware(trial.started_at), _aware(trial.completed_at)
        if here and trial.state.is_finished:
            end, left = trial.state.value, completed
        elif here:
            end, left = "RUNNING", None
        else:
            end, left = "MOVED", ends[array_id]
        joined = started if here and started is not None else starts[array_id]
        members.setdefault(array_id, []).append(
            MemberSpan(
                trial_id=trial.id,
                number=trial.number,
                slot=slot,
                joined_at=joined,
                left_at=left,
                backfill=joined is not None and joined - starts[array_id] > BACKFILL_AFTER,
                end=end,
                value=trial.value,
            )
        )
    spans, devices = [], []
    for array, worker in arrays:
        unfused = solo.get((array.signature, worker.device_type)) if worker else None
        if worker is not None and worker.name not in devices:
            devices.append(worker.name)
        spans.append(
            ArraySpan(
                id=array.id,
                study_id=array.study_id,
                worker=worker.name if worker else None,
                device_type=worker.device_type if worker else None,
                node=worker.node if worker else None,
                state=array.state,
                signature=array.signature,
                created_at=_aware(array.created_at),
                completed_at=_aware(array.completed_at),
                epochs_done=array.epochs_done,
                models_steps_per_s=array.models_steps_per_s,
                unfused_models_steps_per_s=unfused,
                speedup=(array.models_steps_per_s / unfused) if array.models_steps_per_s and unfused else None,
                members=members.get(array.id, []),
                error=array.error,
            )
        )
    return Timeline(study_id=study_id, now=datetime.now(UTC), devices=devices, arrays=spans)


class DeviceOut(BaseModel):
    name: str
    device_type: str
    node: str
    busy: bool = Field(description="It trains an array now.")
    utilisation: float = Field(description="Share of the last five minutes it trained arrays (0 to 1).")
    array_id: int | None = Field(None, description="The array it trains now, when it is the caller's.")
    study_id: int | None = None
    study_name: str | None = None
    members: int | None = Field(None, description="Members of that array still training.")
    models_steps_per_s: float | None = None
    tenant: str | None = Field(None, description="Whose array it trains (the caller's own, or any for the admin).")


class TenantShare(BaseModel):
    name: str
    weight: float
    running_trials: int
    waiting_trials: int
    devices: int = Field(description="Devices training its arrays now.")
    share: float = Field(description="Its part of the busy devices now (0 to 1).")
    fair_share: float = Field(description="weight over the weights of the tenants with unfinished trials (0 if it has none).")


class ClusterOut(BaseModel):
    now: datetime
    devices: list[DeviceOut]
    device_types: dict[str, int] = Field(description="Devices by type.")
    nodes: dict[str, int] = Field(description="Devices by node.")
    tenants: list[TenantShare] = Field(description="The caller's tenant (every tenant for the admin).")
    others: TenantShare | None = Field(None, description="The other tenants together (for a tenant's caller).")


def cluster(session: Session, *, as_tenant: str | None = None) -> ClusterOut:
    """Devices by type and node, what each trains and its utilisation; the tenants' shares."""
    now = datetime.now(UTC)
    workers = session.scalars(select(Worker).order_by(Worker.name)).all()
    running = session.execute(
        select(Array, Study.tenant, Study.name).join(Study, Array.study_id == Study.id).where(Array.state == ArrayState.RUNNING)
    ).all()
    on_worker = {a.worker_id: (a, tenant, name) for a, tenant, name in running if a.worker_id is not None}
    devices = _devices(session, workers, on_worker, now, as_tenant)
    shares, others = _shares(session, on_worker, as_tenant)
    by_type: dict[str, int] = {}
    by_node: dict[str, int] = {}
    for w in workers:
        by_type[w.device_type] = by_type.get(w.device_type, 0) + 1
        by_node[w.node] = by_node.get(w.node, 0) + 1
    return ClusterOut(now=now, devices=devices, device_types=by_type, nodes=by_node, tenants=shares, others=others)


def _devices(
    session: Session, workers: Sequence[Worker], on_worker: Mapping[int, tuple[Array, str, str]], now: datetime, as_tenant: str | None,
) -> list[DeviceOut]:
    """Each worker as a device: busy or not, its utilisation over the window, and the array it
    trains (only the caller's own, for a tenant)."""
    since = now - UTILISATION_WINDOW
    recent = session.execute(
        select(Array.worker_id, Array.created_at, Array.completed_at).where(
            Array.completed_at.is_(None) | (Array.completed_at >= since)
        )
    ).all()
    busy_s: dict[int, float] = {}
    for worker_id, start, end in recent:
        start, end = max(_utc(start), since), min(_aware(end) or now, now)
        if worker_id is not None and end > start:
            busy_s[worker_id] = busy_s.get(worker_id, 0.0) + (end - start).total_seconds()
    live_members = dict(
        session.execute(
            select(Trial.array_id, func.count()).where(Trial.state == TrialState.RUNNING).group_by(Trial.array_id)
        ).all()
    )
    devices = []
    for w in workers:
        here = on_worker.get(w.id)
        device = DeviceOut(
            name=w.name,
            device_type=w.device_type,
            node=w.node,
            busy=here is not None,
            utilisation=min(1.0, busy_s.get(w.id, 0.0) / UTILISATION_WINDOW.total_seconds()),
        )
        if here is not None and (as_tenant is None or here[1] == as_tenant):
            array, tenant, name = here
            device.array_id, device.study_id, device.study_name, device.tenant = array.id, array.study_id, name, tenant
            device.members = live_members.get(array.id, 0)
            device.models_steps_per_s = array.models_steps_per_s
        devices.append(device)
    return devices


def _shares(
    session: Session, on_worker: Mapping[int, tuple[Array, str, str]], as_tenant: str | None,
) -> tuple[list[TenantShare], TenantShare | None]:
    """Each tenant's share of the busy devices against its fair share (a tenant sees its own,
    and the others summed)."""
    counts = session.execute(
        select(Study.tenant, Trial.state, func.count())
        .join(Study, Trial.study_id == Study.id)
        .where(Trial.state.in_([TrialState.RUNNING, TrialState.WAITING]))
        .group_by(Study.tenant, Trial.state)
    ).all()
    trials: dict[str, dict[TrialState, int]] = {}
    for tenant, state, n in counts:
        trials.setdefault(tenant, {})[state] = n
    tenants = {t.name: t.weight for t in session.scalars(select(Tenant))}
    active_weight = sum(w for name, w in tenants.items() if trials.get(name))
    devices_of: dict[str, int] = {}
    for _, tenant, _ in on_worker.values():
        devices_of[tenant] = devices_of.get(tenant, 0) + 1
    n_busy = sum(devices_of.values())

    def share(name: str, weight: float) -> TenantShare:
        mine = trials.get(name, {})
        return TenantShare(
            name=name,
            weight=weight,
            running_trials=mine.get(TrialState.RUNNING, 0),
            waiting_trials=mine.get(TrialState.WAITING, 0),
            devices=devices_of.get(name, 0),
            share=devices_of.get(name, 0) / n_busy if n_busy else 0.0,
            fair_share=weight / active_weight if mine and active_weight else 0.0,
        )

    shares = [share(name, w) for name, w in sorted(tenants.items()) if as_tenant is None or name == as_tenant]
    if as_tenant is None:
        return shares, None
    rest = [share(name, w) for name, w in tenants.items() if name != as_tenant]
    others = TenantShare(
        name="others",
        weight=sum(s.weight for s in rest),
        running_trials=sum(s.running_trials for s in rest),
        waiting_trials=sum(s.waiting_trials for s in rest),
        devices=sum(s.devices for s in rest),
        share=sum(s.share for s in rest),
        fair_share=sum(s.fair_share for s in rest),
    )
    return shares, others
