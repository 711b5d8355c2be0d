"""Trial revisions (server/db/revisions.py): every way the control plane writes a trial
stamps it, one revision per committed transaction, in ft_trial_revisions; a rolled-back
transaction stamps nothing. Against real SQLite and PostgreSQL, through the app's tables."""

from __future__ import annotations

import httpx
from sqlalchemy import insert, select, update

from fusetune.server.db import Study, Trial, TrialRevision, TrialState, get_optuna_storage, get_sessionmaker
from fusetune.server.db.revisions import current_revision, touch_trials
from tests.server.test_reads import make_study, seed


def stamps(url: str, study_id: int) -> dict[int, int]:
    with get_sessionmaker(url)() as session:
        rows = session.execute(select(TrialRevision.trial_id, TrialRevision.revision).where(TrialRevision.study_id == study_id))
        return dict(rows.all())


def test_every_way_of_writing_a_trial_stamps_it_with_its_transactions_revision(api: httpx.Client, database_url: str) -> None:
    study_id = make_study(api, "stamped")["id"]
    sessions = get_sessionmaker(database_url)

    # New Trial objects (a flush): one row each, with the transaction's one revision.
    added = seed(database_url, study_id, [(TrialState.WAITING, None, {})] * 3)
    first = stamps(database_url, study_id)
    assert set(first) == set(added) and len(set(first.values())) == 1
    with sessions() as session:
        assert first[added[0]] == current_revision(session)

    # A Core insert statement (the coordinator's asks): the new rows only.
    storage = get_optuna_storage(database_url)
    with sessions() as session:
        optuna_study_id = session.get(Study, study_id).optuna_study_id
    optuna_ids = [storage.create_new_trial(optuna_study_id) for _ in range(2)]
    with sessions() as session:
        inserted = list(session.execute(insert(Trial).returning(Trial.id), [
            {"study_id": study_id, "optuna_trial_id": o, "number": 3 + k, "params": {}, "signature": "s" * 64}
            for k, o in enumerate(optuna_ids)
        ]).scalars())
        session.commit()
    second = stamps(database_url, study_id)
    assert {t: second[t] for t in added} == first  # the others kept theirs
    assert len({second[t] for t in inserted}) == 1 and second[inserted[0]] > max(first.values())

    # An update statement whose condition is on a column it changes: the rows it changed.
    with sessions() as session:
        session.execute(update(Trial).where(Trial.id.in_(added[:2]), Trial.state == TrialState.WAITING).values(state=TrialState.RUNNING))
        session.commit()
    third = stamps(database_url, study_id)
    assert third[added[0]] == third[added[1]] > max(second.values())
    assert {t: third[t] for t in [added[2], *inserted]} == {t: second[t] for t in [added[2], *inserted]}

    # A changed attribute of a loaded Trial, and a touch (its Optuna trial changed), together: one revision.
    with sessions() as session:
        session.get(Trial, added[2]).error = "diverged"
        touch_trials(session, [inserted[0]])
        session.commit()
    fourth = stamps(database_url, study_id)
    assert fourth[added[2]] == fourth[inserted[0]] > max(third.values())
    with sessions() as session:  # and the trial reads it as its revision
        assert session.get(Trial, added[2]).revision == fourth[added[2]]

    # Rolled back: nothing stamped.
    with sessions() as session:
        session.execute(update(Trial).where(Trial.study_id == study_id).values(error="lost"))
        touch_trials(session, added)
        session.rollback()
    assert stamps(database_url, study_id) == fourth
