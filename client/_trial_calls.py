"""The client's calls on trials and the arrays that train them: read them (or only what
changed), download a trial's weights, enqueue a trial, and answer a pruning question."""

from __future__ import annotations

import os
from typing import Any

from ._http import Connection, _failure


class TrialCalls(Connection):
    """Trials (``/api/v1/studies/{id}/trials``, ``/api/v1/trials``) and arrays (``/api/v1/arrays``)."""

    def trials(
        self,
        study_id: int,
        *,
        state: str | list[str] | None = None,
        sort: str | None = None,
        updated_since: int | None = None,
        max_points: int | None = None,
    ) -> list[dict[str, Any]]:
        """The study's trials, every page: by ``number`` unless ``sort`` says otherwise
        (``-number``, ``value``, ``-value``, ``revision``), only those in ``state`` if given,
        only those changed after revision ``updated_since`` if given (see :meth:`changes`),
        learning curves downsampled to ``max_points`` if given."""
        return self._listing(
            f"/api/v1/studies/{study_id}/trials", state=state, sort=sort, updated_since=updated_since, max_points=max_points
        )

    def changes(self, study_id: int, since: int = 0) -> tuple[list[dict[str, Any]], int]:
        """The trials of the study that changed after revision ``since`` (0: all of them), in
        the order of their changes, and the revision to pass next time: a poller downloads
        each change once, and only the changes."""
        rows = self.trials(study_id, updated_since=since)
        return rows, max([since, *(row["revision"] for row in rows)])

    def trial(self, trial_id: int, *, max_points: int | None = None) -> dict[str, Any]:
        params = {"max_points": max_points} if max_points is not None else {}
        return self._call("GET", f"/api/v1/trials/{trial_id}", params=params)

    def download_state_dict(self, trial_id: int, path: str | os.PathLike[str] | None = None) -> bytes:
        """The trained weights of a COMPLETE trial: the bytes of ``torch.save(state_dict)``
        (``torch.load(io.BytesIO(data))``), also written to ``path`` if given."""
        response = self._http.get(f"/api/v1/trials/{trial_id}/state_dict")
        if response.is_error:
            raise _failure(response)
        if path is not None:
            with open(path, "wb") as f:
                f.write(response.content)
        return response.content

    def enqueue_trial(self, study_id: int, params: dict[str, Any], user_attrs: dict[str, Any] | None = None) -> dict[str, Any]:
        """Optuna's ``enqueue_trial`` on the service: the study's next trial, asked at once."""
        body = {"params": params, "user_attrs": user_attrs or {}}
        return self._call("POST", f"/api/v1/studies/{study_id}/trials", json=body)

    def decide_pruning(self, trial_id: int, step: int, prune: bool) -> dict[str, Any]:
        """A client-driven study's pruning decision on the trial's value at ``step``."""
        return self._call("POST", f"/api/v1/trials/{trial_id}/pruning", json={"step": step, "prune": prune})

    def arrays(self, study_id: int | None = None, *, state: str | list[str] | None = None) -> list[dict[str, Any]]:
        """The arrays this token sees (every page), of one study or in ``state`` if given."""
        return self._listing("/api/v1/arrays", study_id=study_id, state=state)
