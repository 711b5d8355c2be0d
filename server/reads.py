"""Reads that scale to studies of 100,000 trials: pages by keyset, rows built in batches.

The service layer (``server/service.py``) scopes a request to the caller's tenant and calls
these. A page costs a constant number of queries whatever its length and wherever it is in
the listing: one for its rows (an index range scan, ``ix_ft_trials_*``), then one UNION ALL
over Optuna's trial tables (values, intermediate values, params, attrs) for all its rows;
a page of studies computes every study's trial counts and best trial in SQL for the whole
page. Nothing here reads a study's trials through Optuna's ``RDBStorage.get_all_trials``.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any, Literal, TypeVar

import numpy as np
import optuna
from optuna.study import StudyDirection
from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Float,
    Integer,
    Select,
    String,
    any_,
    bindparam,
    case,
    cast,
    func,
    literal,
    null,
    select,
    tuple_,
    union_all,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session, aliased, joinedload, selectinload

from fusetune.server.curves import downsample
from fusetune.server.db import Array, Study, Trial, TrialRevision, TrialState
from fusetune.server.db import optuna_tables as rdb
from fusetune.server.pagination import ID_CURSOR, TRIAL_CURSOR, Page, PageParams, TrialKey
from fusetune.server.schemas import ArrayOut, BestTrial, StudyOut, TrialOut

__all__ = ["ID_SORTS", "TRIAL_SORTS", "arrays_page", "keyset_page", "study_outs", "trial_outs", "trials_page"]

#: How a study's trials can be sorted; ``-`` is descending. Ties go by id. Trials without a
#: value come last in both value orders.
TRIAL_SORTS = ("number", "-number", "value", "-value", "revision")
#: How studies and arrays can be sorted.
ID_SORTS = ("id", "-id")

_R = TypeVar("_R")
_NONE = type(None)


def _among(session: Session, column: Any, ids: Sequence[int]) -> ColumnElement[bool]:
    """``column IN ids``; on PostgreSQL ``column = ANY(:ids)``, one array parameter: a page's
    hundreds of ids then make one short statement that stays prepared, not a new long one."""
    if session.get_bind().dialect.name == "postgresql":
        return column == any_(literal(list(ids), ARRAY(Integer)))
    return column.in_(ids)


# -- keyset pages ------------------------------------------------------------------------------
def keyset_page(
    session: Session,
    query: Select[_R],
    columns: Sequence[Any],
    descending: bool,
    after: Sequence[Any] | None,
    limit: int,
) -> tuple[list[_R], bool]:
    """Up to ``limit`` rows of ``query`` ordered by ``columns`` (a unique key), after the row
    whose key is ``after``; and whether more follow."""
    if after is not None:
        bound = [_bound(value) for value in after]
        if len(columns) == 1:
            query = query.where(columns[0] < bound[0] if descending else columns[0] > bound[0])
        else:
            key, seek = tuple_(*columns), tuple_(*bound)
            query = query.where(key < seek if descending else key > seek)
    order = [c.desc() if descending else c.asc() for c in columns]
    rows = list(session.scalars(query.order_by(*order).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def _bound(value: Any) -> Any:
    """A cursor's key value as the statement's parameter: an integer as a BIGINT, since a
    cursor's may be past a 32-bit INTEGER column's range (PostgreSQL would refuse to cast it to
    the column's type; compared as BIGINT it is merely after every row)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return literal(value, BigInteger())
    return value


def id_page(session: Session, query: Select[_R], column: Any, sort: str, page: PageParams) -> Page[_R]:
    """A page of ``query`` by its integer id ``column``, ``sort`` one of :data:`ID_SORTS`."""
    after = (ID_CURSOR.decode(page.after),) if page.after else None
    rows, more = keyset_page(session, query, (column,), sort.startswith("-"), after, page.limit)
    return Page(rows, ID_CURSOR.encode(_attr(rows[-1], column)) if more else None)


def _attr(row: Any, column: Any) -> Any:
    return getattr(row, column.key)


# -- trials ------------------------------------------------------------------------------------
def trials_page(
    session: Session,
    study: Study,
    *,
    states: Sequence[TrialState] | None = None,
    sort: str = "number",
    updated_since: int | None = None,
    page: PageParams = PageParams(),
    max_points: int | None = None,
) -> Page[TrialOut]:
    """A page of the study's trials, in ``sort`` order, optionally only of ``states`` and only
    those changed after revision ``updated_since`` (then ``sort`` is ``revision``)."""
    query = select(Trial).where(Trial.study_id == study.id)
    if states:
        query = query.where(Trial.state.in_(list(states)))
    if updated_since is not None or sort == "revision":
        # The study's changes are one range of ft_trial_revisions' index (revision order).
        query = query.join(TrialRevision, TrialRevision.trial_id == Trial.id).where(TrialRevision.study_id == study.id)
    if updated_since is not None:
        query = query.where(TrialRevision.revision > updated_since)
    after = TRIAL_CURSOR.decode(page.after) if page.after else None
    if sort in ("value", "-value"):
        rows, more = _value_page(session, query, sort == "-value", after, page.limit)
    else:
        columns = (TrialRevision.revision, TrialRevision.trial_id) if sort == "revision" else (Trial.number, Trial.id)
        seek = None if after is None else (after.revision, after.id) if sort == "revision" else (after.number, after.id)
        rows, more = keyset_page(session, query, columns, sort.startswith("-"), seek, page.limit)
    if not more:
        return Page(trial_outs(session, rows, max_points=max_points), None)
    last = rows[-1]  # a trial not yet in ft_trial_revisions has no place in that order: 0 stands for it
    revision = getattr(last, "revision", None) or 0  # Trial.revision: a column property (models.py)
    next_cursor = TRIAL_CURSOR.encode(TrialKey(last.number, last.id, revision, last.value))
    return Page(trial_outs(session, rows, max_points=max_points), next_cursor)


def _value_page(
    session: Session, query: Select[Trial], descending: bool, after: TrialKey | None, limit: int
) -> tuple[list[Trial], bool]:
    """Up to ``limit`` trials after ``after``: those with a value by value (ties by id), then
    those without one by id; and whether more follow. A position without a value is in the
    second run."""
    rows: list[Trial] = []
    seek: tuple[Any, ...] | None
    if after is None or after.value is not None:
        seek = None if after is None else (after.value, after.id)
        rows, more = keyset_page(session, query.where(Trial.value.is_not(None)), (Trial.value, Trial.id), descending, seek, limit)
        if more:
            return rows, True
    seek = (after.id,) if after is not None and after.value is None else None
    nulls, more = keyset_page(session, query.where(Trial.value.is_(None)), (Trial.id,), False, seek, limit - len(rows))
    return rows + nulls, more


@lru_cache(maxsize=4096)
def _distribution_json(stored: str) -> Any:
    """A stored distribution as the API shows it: Optuna's current JSON of it (old forms, like
    UniformDistribution, come back as what Optuna reads them as)."""
    return json.loads(optuna.distributions.distribution_to_json(optuna.distributions.json_to_distribution(stored)))


_VALUE, _STEP, _PARAM, _USER_ATTR, _SYSTEM_ATTR = range(5)


def _optuna_rows(session: Session, ids: Sequence[int]) -> Any:
    """What Optuna's five trial tables hold of these trials, in one statement (one round trip):
    rows of (kind, Optuna trial id, objective/step/param id, param or attr name, value, its
    stored type, JSON)."""
    postgres = session.get_bind().dialect.name == "postgresql"
    # all(): the driver's fetchall builds the rows at once; iterating fetched them one by one
    # (a poll of 16 live trials is ~350 rows, which cost a millisecond that way).
    return session.execute(_optuna_rows_statement(postgres), {"ids": list(ids)}).all()


@lru_cache(maxsize=2)
def _optuna_rows_statement(postgres: bool) -> Any:
    """The statement of :func:`_optuna_rows`, built once per dialect: building it per request
    cost more than running it. The ids are one array parameter on PostgreSQL."""
    tv, iv, tp = rdb.TrialValueModel, rdb.TrialIntermediateValueModel, rdb.TrialParamModel
    ua, sa = rdb.TrialUserAttributeModel, rdb.TrialSystemAttributeModel
    no_text, no_number = cast(null(), String), cast(null(), Float)
    ids = bindparam("ids", type_=ARRAY(Integer)) if postgres else bindparam("ids", expanding=True)

    def part(kind: int, model: Any, k: Any, name: Any, value: Any, stored_type: Any, text: Any) -> Select[Any]:
        among = model.trial_id == any_(ids) if postgres else model.trial_id.in_(ids)
        return select(
            literal(kind).label("kind"), model.trial_id.label("trial_id"), k.label("k"), name.label("name"),
            value.label("value"), stored_type.label("stored_type"), text.label("text"),
        ).where(among)

    return union_all(
        part(_VALUE, tv, tv.objective, no_text, tv.value, cast(tv.value_type, String), no_text),
        part(_STEP, iv, iv.step, no_text, iv.intermediate_value, cast(iv.intermediate_value_type, String), no_text),
        part(_PARAM, tp, tp.param_id, tp.param_name, no_number, no_text, tp.distribution_json),
        part(_USER_ATTR, ua, literal(0), ua.key, no_number, no_text, ua.value_json),
        part(_SYSTEM_ATTR, sa, literal(0), sa.key, no_number, no_text, sa.value_json),
    )


def trial_outs(session: Session, trials: Sequence[Trial], *, max_points: int | None = None) -> list[TrialOut]:
    """The trials as the API shows them, with what Optuna's tables hold of them: one statement
    for all of them (``_optuna_rows``). ``max_points``: downsample each learning curve to that many."""
    ids = [t.optuna_trial_id for t in trials]
    values: dict[int, dict[int, float]] = defaultdict(dict)
    curves: dict[int, dict[int, float]] = defaultdict(dict)
    distributions: dict[int, dict[str, Any]] = defaultdict(dict)
    user_attrs: dict[int, dict[str, Any]] = defaultdict(dict)
    system_attrs: dict[int, dict[str, Any]] = defaultdict(dict)
    if ids:
        tv, iv = rdb.TrialValueModel, rdb.TrialIntermediateValueModel
        params: dict[int, list[tuple[int, str, str]]] = defaultdict(list)
        for kind, trial_id, k, name, value, stored_type, text in _optuna_rows(session, ids):
            if kind == _VALUE:
                values[trial_id][k] = value if stored_type == "FINITE" else tv.stored_repr_to_value(value, tv.TrialValueType[stored_type])
            elif kind == _STEP:
                curves[trial_id][k] = (
                    value if stored_type == "FINITE"
                    else iv.stored_repr_to_intermediate_value(value, iv.TrialIntermediateValueType[stored_type])
                )
            elif kind == _PARAM:
                params[trial_id].append((k, name, text))
            else:
                (user_attrs if kind == _USER_ATTR else system_attrs)[trial_id][name] = json.loads(text)
        for trial_id, rows in params.items():
            distributions[trial_id] = {name: _distribution_json(stored) for _, name, stored in sorted(rows)}
    out = []
    for trial in trials:
        oid = trial.optuna_trial_id
        curve = curves.get(oid, {})
        out.append(
            TrialOut.model_validate(trial).model_copy(  # what Optuna's tables add, without validating again
                update={
                    "intermediate_values": downsample(curve, max_points) if max_points else dict(sorted(curve.items())),
                    "values": [values[oid][k] for k in sorted(values[oid])] if oid in values else None,
                    "distributions": distributions.get(oid, {}),
                    "user_attrs": user_attrs.get(oid, {}),
                    "system_attrs": system_attrs.get(oid, {}),
                }
            )
        )
    return out


# -- studies -----------------------------------------------------------------------------------
def study_outs(session: Session, studies: Sequence[Study]) -> list[StudyOut]:
    """The studies as the API shows them, with their trial counts and best trial (single
    objective) or Pareto front (several), Optuna's directions and attrs: a constant number of
    queries for the whole page, none per study."""
    if not studies:
        return []
    ids = [s.id for s in studies]
    optuna_ids = [s.optuna_study_id for s in studies]

    counts: dict[int, dict[str, int]] = defaultdict(dict)
    for study_id, state, n in session.execute(
        select(Trial.study_id, Trial.state, func.count()).where(_among(session, Trial.study_id, ids)).group_by(Trial.study_id, Trial.state)
    ):
        counts[study_id][TrialState(state).value] = n

    sd = rdb.StudyDirectionModel
    directions: dict[int, dict[int, StudyDirection]] = defaultdict(dict)
    for optuna_id, objective, direction in session.execute(
        select(sd.study_id, sd.objective, sd.direction).where(_among(session, sd.study_id, optuna_ids))
    ):
        directions[optuna_id][objective] = direction
    user_attrs: dict[int, dict[str, Any]] = defaultdict(dict)
    system_attrs: dict[int, dict[str, Any]] = defaultdict(dict)
    for model, into in ((rdb.StudyUserAttributeModel, user_attrs), (rdb.StudySystemAttributeModel, system_attrs)):
        for attr_study, key, value_json in session.execute(
            select(model.study_id, model.key, model.value_json).where(_among(session, model.study_id, optuna_ids))
        ):
            if attr_study is not None:  # (Optuna's column is nullable; its rows always name one)
                into[attr_study][key] = json.loads(value_json)

    outs = []
    single: list[Study] = []
    multi: list[Study] = []
    for study in studies:
        oid = study.optuna_study_id
        out = _study_out(
            study, [directions[oid][k] for k in sorted(directions[oid])], user_attrs.get(oid, {}), system_attrs.get(oid, {}),
            counts[study.id],
        )
        if out.trial_counts[TrialState.COMPLETE.value]:
            (multi if len(out.directions) > 1 else single).append(study)
        outs.append(out)
    by_id = {out.id: out for out in outs}
    for study_id, best in _best_trials(session, single).items():
        by_id[study_id].best_trial = best
    for study_id, front in _pareto_fronts(session, multi, {s.id: directions[s.optuna_study_id] for s in multi}).items():
        by_id[study_id].best_trials = front
    return outs


def new_study_out(study: Study, directions: Sequence[StudyDirection], system_attrs: Mapping[str, Any]) -> StudyOut:
    """A study its transaction has just created, as :func:`study_outs` shows it, from what that
    transaction wrote (no trials, no user attrs) and without a query: the answer to its POST
    is built while the scheduling loop asks its first trials, in the same process."""
    return _study_out(study, directions, {}, dict(system_attrs), {})


_DIRECTION: dict[StudyDirection, Literal["minimize", "maximize"]] = {
    StudyDirection.MINIMIZE: "minimize", StudyDirection.MAXIMIZE: "maximize",
}


def _study_out(
    study: Study, directions: Sequence[StudyDirection], user_attrs: dict[str, Any], system_attrs: dict[str, Any],
    counts: Mapping[str, int],
) -> StudyOut:
    out = StudyOut.model_validate(study)
    out.directions = [_DIRECTION[d] for d in directions]
    out.user_attrs, out.system_attrs = user_attrs, system_attrs
    out.trial_counts = {state.value: counts.get(state.value, 0) for state in TrialState}
    return out


def _best_trials(session: Session, studies: Sequence[Study]) -> dict[int, BestTrial]:
    """Each single-objective study's best COMPLETE trial (ties: the lowest number), in SQL:
    one index seek per study (``ix_ft_trials_study_state_value``), all in one statement."""
    if not studies:
        return {}
    t = aliased(Trial)

    def best(descending: bool) -> ColumnElement[int]:
        order = t.value.desc() if descending else t.value.asc()
        return (
            select(t.id)
            .where(t.study_id == Study.id, t.state == TrialState.COMPLETE, t.value.is_not(None))
            .order_by(order, t.number)
            .limit(1)
            .correlate(Study)
            .scalar_subquery()
        )

    best_id = case((Study.direction == "maximize", best(True)), else_=best(False)).label("best_id")
    picked = (
        select(Study.id.label("study_id"), best_id).where(_among(session, Study.id, [s.id for s in studies])).subquery()
    )
    rows = session.execute(
        select(picked.c.study_id, Trial.number, Trial.value, Trial.params).join(Trial, Trial.id == picked.c.best_id)
    )
    return {
        study_id: BestTrial(number=number, value=value, params=params, values=[value])
        for study_id, number, value, params in rows
    }


class _FrontCache:
    """Pareto fronts by study, valid while the study's newest trial revision is unchanged."""

    def __init__(self, size: int = 256) -> None:
        self._lock = threading.Lock()
        self._fronts: dict[int, tuple[int, list[BestTrial]]] = {}
        self._size = size

    def get(self, study_id: int, revision: int) -> list[BestTrial] | None:
        with self._lock:
            hit = self._fronts.get(study_id)
        return [b.model_copy(deep=True) for b in hit[1]] if hit is not None and hit[0] == revision else None

    def put(self, study_id: int, revision: int, front: list[BestTrial]) -> None:
        with self._lock:
            if len(self._fronts) >= self._size:
                self._fronts.pop(next(iter(self._fronts)))
            self._fronts[study_id] = (revision, [b.model_copy(deep=True) for b in front])


_fronts = _FrontCache()


def _pareto_fronts(
    session: Session, studies: Sequence[Study], directions: Mapping[int, Mapping[int, StudyDirection]]
) -> dict[int, list[BestTrial]]:
    """Each multi-objective study's Pareto front of Optuna-COMPLETE trials, as Optuna's
    ``best_trials`` (fusetune's studies set no constraints), by trial number.

    Every value of the study's complete trials is read (one query for the page), so a front
    is kept until a trial of its study changes again (its newest revision moves).
    """
    if not studies:
        return {}
    newest = dict(
        session.execute(
            select(TrialRevision.study_id, func.max(TrialRevision.revision))
            .where(TrialRevision.study_id.in_([s.id for s in studies]))
            .group_by(TrialRevision.study_id)
        ).all()
    )
    out: dict[int, list[BestTrial]] = {}
    missing = []
    for study in studies:
        cached = _fronts.get(study.id, newest.get(study.id, 0))
        if cached is None:
            missing.append(study)
        else:
            out[study.id] = cached
    if not missing:
        return out
    tv, ot = rdb.TrialValueModel, rdb.TrialModel
    values: dict[int, dict[int, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))  # study -> optuna trial -> objective
    numbers: dict[int, int] = {}
    for study_id, trial_id, number, objective, value, kind in session.execute(
        select(Trial.study_id, Trial.optuna_trial_id, Trial.number, tv.objective, tv.value, tv.value_type)
        .join(ot, ot.trial_id == Trial.optuna_trial_id)
        .join(tv, tv.trial_id == Trial.optuna_trial_id)
        .where(Trial.study_id.in_([s.id for s in missing]), ot.state == optuna.trial.TrialState.COMPLETE)
    ):
        values[study_id][trial_id][objective] = tv.stored_repr_to_value(value, kind)
        numbers[trial_id] = number
    fronts: dict[int, list[int]] = {}
    for study in missing:
        signs = [1.0 if directions[study.id][k] == StudyDirection.MINIMIZE else -1.0 for k in sorted(directions[study.id])]
        trial_ids = sorted(values[study.id], key=lambda i: numbers[i])
        trial_ids = [i for i in trial_ids if len(values[study.id][i]) == len(signs)]
        if not trial_ids:
            fronts[study.id] = []
            continue
        loss = np.asarray([[sign * values[study.id][i][k] for k, sign in enumerate(signs)] for i in trial_ids])
        on_front = optuna.study._multi_objective._is_pareto_front(loss, assume_unique_lexsorted=False)
        fronts[study.id] = [i for i, keep in zip(trial_ids, on_front) if keep]
    # Params as Optuna holds them (as Optuna's best_trials shows them).
    tp = rdb.TrialParamModel
    params: dict[int, dict[str, Any]] = defaultdict(dict)
    front_ids = [i for ids in fronts.values() for i in ids]
    for start in range(0, len(front_ids), 1000):
        for param_trial, name, value, stored in session.execute(
            select(tp.trial_id, tp.param_name, tp.param_value, tp.distribution_json)
            .where(tp.trial_id.in_(front_ids[start : start + 1000]))
            .order_by(tp.param_id)
        ):
            if param_trial is not None:  # (Optuna's column is nullable; its rows always name one)
                params[param_trial][name] = optuna.distributions.json_to_distribution(stored).to_external_repr(value)
    for study in missing:
        front = []
        for i in fronts[study.id]:
            scores = [values[study.id][i][k] for k in sorted(values[study.id][i])]
            front.append(BestTrial(number=numbers[i], value=scores[0], params=params.get(i, {}), values=scores))
        _fronts.put(study.id, newest.get(study.id, 0), front)
        out[study.id] = front
    return out


# -- arrays ------------------------------------------------------------------------------------
def arrays_page(session: Session, query: Select[Array], sort: str, page: PageParams) -> Page[ArrayOut]:
    """A page of arrays with their members and workers loaded for the whole page at once."""
    query = query.options(selectinload(Array.members), joinedload(Array.worker))
    found = id_page(session, query, Array.id, sort, page)
    return Page([ArrayOut.model_validate(a) for a in found.items], found.next)


def optuna_study_named(session: Session, name: str) -> int | None:
    """The id of the Optuna study named ``name`` (None: none is)."""
    return session.scalar(select(rdb.StudyModel.study_id).where(rdb.StudyModel.study_name == name))


def objectives(session: Session, optuna_study_id: int) -> int:
    """How many objectives (directions) the Optuna study has."""
    return session.scalar(
        select(func.count()).select_from(rdb.StudyDirectionModel).where(rdb.StudyDirectionModel.study_id == optuna_study_id)
    ) or 0


def trial_user_attr(session: Session, optuna_trial_id: int, key: str) -> Any:
    """One user attr of an Optuna trial, decoded (None: it has none of that key)."""
    model = rdb.TrialUserAttributeModel
    stored = session.scalar(select(model.value_json).where(model.trial_id == optuna_trial_id, model.key == key))
    return json.loads(stored) if stored is not None else None
