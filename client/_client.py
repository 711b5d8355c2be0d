"""A small typed client for fusetune's REST API."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx

FINISHED = {"COMPLETE", "PRUNED", "FAIL"}
#: Rows per page when the client reads a whole listing (the service's most).
PAGE_SIZE = 1000
#: A study's end states; it has ended once it is in one with ``completed_at`` set (no trial runs).
ENDED = {"COMPLETE", "CANCELLED", "FAILED"}


#: The service a client talks to when no ``url`` is given and ``FUSETUNE_URL`` is unset.
DEFAULT_URL = "http://127.0.0.1:8000"


def service_url(url: str | None = None) -> str:
    """``url``, else ``FUSETUNE_URL``, else :data:`DEFAULT_URL`."""
    return url or os.environ.get("FUSETUNE_URL", DEFAULT_URL)


class FusetuneError(RuntimeError):
    """The service answered with an error; ``status_code`` and ``detail`` say which."""

    def __init__(self, status_code: int, detail: Any) -> None:
        super().__init__(f"HTTP {status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail


def segment(text: str) -> str:
    """``text`` as one path segment of a URL: every character but letters, digits, ``-``,
    ``_`` and ``~`` percent-encoded, so a ``/``, ``?``, ``#`` or ``%`` in it stays in it, and
    ``.`` too (httpx would resolve a ``.`` or ``..`` segment away)."""
    return quote(text, safe="").replace(".", "%2E")


def _failure(response: httpx.Response) -> FusetuneError:
    """The error an answer of the service says."""
    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = response.text
    return FusetuneError(response.status_code, detail)


class Client:
    """Talks to one fusetune service, e.g. ``Client("http://127.0.0.1:8000", token=...)``.

    ``url`` is ``FUSETUNE_URL`` when omitted; ``token`` is a tenant's (or the admin's) bearer
    token, ``FUSETUNE_TOKEN`` when omitted.
    """

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0) -> None:
        self.url = service_url(url).rstrip("/")
        token = token if token is not None else os.environ.get("FUSETUNE_TOKEN")
        self.token = token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._http.request(method, path, **kwargs)
        if response.is_error:
            try:
                detail = response.json().get("detail")
            except ValueError:
                detail = response.text
            raise FusetuneError(response.status_code, detail)
        return response.json() if response.content else None  # 204: no body

    def pages(self, path: str, params: dict[str, Any] | None = None) -> Iterator[list[dict[str, Any]]]:
        """Each page of a listing route (``/api/v1/studies``, ``.../trials``, ...), following
        the ``Link: <...>; rel="next"`` header of each until the last page."""
        url: str | None = path
        while url is not None:
            response = self._http.get(url, params=params)
            if response.is_error:
                raise _failure(response)
            yield response.json()
            url, params = response.links.get("next", {}).get("url"), None  # the link carries the query

    def _listing(self, path: str, **params: Any) -> list[dict[str, Any]]:
        """Every row of a listing; ``params`` left None are not sent."""
        query = {"limit": PAGE_SIZE, **{k: v for k, v in params.items() if v is not None}}
        return [row for page in self.pages(path, query) for row in page]

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/healthz")

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
        return self._call("PUT", f"/api/v1/studies/{study_id}/user_attrs/{segment(key)}", json={"value": value})

    def arrays(self, study_id: int | None = None, *, state: str | list[str] | None = None) -> list[dict[str, Any]]:
        """The arrays this token sees (every page), of one study or in ``state`` if given."""
        return self._listing("/api/v1/arrays", study_id=study_id, state=state)

    # Tenants and tokens. Creating tenants and changing weights or quotas takes the admin's token.

    def tenants(self) -> list[dict[str, Any]]:
        """Every tenant (admin), or this token's own tenant."""
        return self._listing("/api/v1/tenants")

    def create_tenant(self, name: str, weight: float = 1.0, **fields: Any) -> dict[str, Any]:
        """A new tenant (admin): ``{"tenant": {...}, "token": {"id": ..., "token": ...}}``; the
        token is shown only here. ``fields``: max_running_studies, max_trials_per_study, token_label."""
        return self._call("POST", "/api/v1/tenants", json={"name": name, "weight": weight, **fields})

    def update_tenant(self, name: str, **fields: Any) -> dict[str, Any]:
        """Change a tenant's weight, max_running_studies or max_trials_per_study (admin; None: no limit)."""
        return self._call("PATCH", f"/api/v1/tenants/{segment(name)}", json=fields)

    def set_weight(self, name: str, weight: float) -> dict[str, Any]:
        return self.update_tenant(name, weight=weight)

    def tokens(self, tenant: str) -> list[dict[str, Any]]:
        """A tenant's tokens: ids, labels, dates (never the tokens themselves)."""
        return self._listing(f"/api/v1/tenants/{segment(tenant)}/tokens")

    def create_token(self, tenant: str, label: str | None = None) -> dict[str, Any]:
        """Another token for ``tenant`` (the admin, or the tenant itself); ``["token"]`` is shown only here."""
        return self._call("POST", f"/api/v1/tenants/{segment(tenant)}/tokens", json={"label": label})

    def revoke_token(self, token_id: int) -> dict[str, Any]:
        return self._call("DELETE", f"/api/v1/tokens/{token_id}")

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
