"""The client's calls on studies: submit, read, steer (pause, resume, cancel, more trials),
delete, and wait for one to end on its event stream."""

from __future__ import annotations

import time
from typing import Any

import httpx

from ._http import Connection, segment

#: A study's end states; it has ended once it is in one with ``completed_at`` set (no trial runs).
ENDED = {"COMPLETE", "CANCELLED", "FAILED"}


class StudyCalls(Connection):
    """Studies: ``/api/v1/studies`` and what hangs off one study."""

    def create_study(self, workload: str, n_trials: int, **fields: Any) -> dict[str, Any]:
        """Submit a study; ``fields`` are the optional request fields (epochs, sampler, ...)."""
        return self._call("POST", "/api/v1/studies", json={"workload": workload, "n_trials": n_trials, **fields})

    def submit(self, request: dict[str, Any]) -> dict[str, Any]:
        """Submit a study given as the raw request body (e.g. loaded from ``sweep.json``)."""
        return self._call("POST", "/api/v1/studies", json=request)

    def studies(
        self, name: str | None = None, *, tenant: str | None = None, state: str | list[str] | None = None
    ) -> list[dict[str, Any]]:
        """The studies this token sees (every page); only the one named ``name``, those of
        ``tenant`` (the admin) or in ``state`` (one or several) if given."""
        return self._listing("/api/v1/studies", name=name, tenant=tenant, state=state)

    def study(self, study_id: int) -> dict[str, Any]:
        return self._call("GET", f"/api/v1/studies/{study_id}")

    def pause_study(self, study_id: int) -> dict[str, Any]:
        """Nothing new starts; running trials leave their arrays at the next epoch boundary and wait."""
        return self._call("POST", f"/api/v1/studies/{study_id}/pause")

    def resume_study(self, study_id: int) -> dict[str, Any]:
        """A paused study runs again; its trials resume from their checkpoints."""
        return self._call("POST", f"/api/v1/studies/{study_id}/resume")

    def cancel_study(self, study_id: int) -> dict[str, Any]:
        """End the study CANCELLED; its unfinished trials end PRUNED (or FAIL) with the reason."""
        return self._call("POST", f"/api/v1/studies/{study_id}/cancel")

    def update_study(self, study_id: int, n_trials: int) -> dict[str, Any]:
        """Set the study's ``n_trials`` (more trials; a COMPLETE study runs again)."""
        return self._call("PATCH", f"/api/v1/studies/{study_id}", json={"n_trials": n_trials})

    def delete_study(self, study_id: int) -> dict[str, Any] | None:
        """Delete the study, its Optuna study and its artifacts: None once gone; the study
        (state DELETING) when arrays of it still train, until they stop."""
        return self._call("DELETE", f"/api/v1/studies/{study_id}")

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> dict[str, Any]:
        """Optuna's ``study.set_user_attr``: the study, with ``key`` set to ``value`` (JSON).

        Raises:
            ValueError: naming ``key`` if it is empty or holds NUL (the service's key is one
                URL path segment of 1-512 characters).
        """
        if not key or "\x00" in key:
            raise ValueError(f"key: a study's user attr key must be 1-512 characters without NUL, not {key!r}")
        return self._call("PUT", f"/api/v1/studies/{study_id}/user_attrs/{segment(key)}", json={"value": value})

    def wait(self, study_id: int, timeout: float = 600.0, poll: float = 1.0, on_poll: Any = None) -> dict[str, Any]:
        """Block until the study has ended (COMPLETE, CANCELLED or FAILED, and no trial of it runs).

        It follows the study's event stream for ``study.completed`` (``?kind=``), so it returns
        as the service commits the end, not at its next poll; the study is read again at least
        every ``poll`` seconds all the same (a stream a proxy cut), and ``on_poll(study)`` is
        called on each read. The stream is opened before each read, so an end committed
        between the two is on it.
        """
        deadline = time.monotonic() + timeout
        path, params = f"/api/v1/studies/{study_id}/events", {"kind": "study.completed"}
        while True:
            wait_s = max(0.01, min(poll, deadline - time.monotonic()))
            read = httpx.Timeout(self._http.timeout.connect, read=wait_s, write=self._http.timeout.write, pool=self._http.timeout.pool)
            with self._http.stream("GET", path, params=params, timeout=read) as events:
                study = self.study(study_id)
                if on_poll is not None:
                    on_poll(study)
                if study["state"] in ENDED and study["completed_at"] is not None:
                    return study
                if time.monotonic() > deadline:
                    raise TimeoutError(f"study {study_id} not complete after {timeout:.0f} s: {study['trial_counts']}")
                if events.is_error:  # a service without the stream: poll
                    time.sleep(wait_s)
                    continue
                try:
                    for line in events.iter_lines():
                        if line.startswith("event:"):
                            break
                except httpx.ReadTimeout:  # nothing within wait_s: read the study again
                    pass
