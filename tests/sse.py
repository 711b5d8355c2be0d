"""Reading server-sent events in tests: the wire format, parsed as an EventSource would."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

import httpx


def parse(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """Events from the lines of a text/event-stream: ``{"id", "event", "data"}``, data JSON-decoded.

    Comments (``: ping``) are skipped; an event ends at a blank line.
    """
    event: dict[str, Any] = {}
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield {**event, "data": json.loads("\n".join(data))}
            event, data = {}, []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "data":
            data.append(value)
        elif field in ("id", "event", "retry"):
            event[field] = value


def events_of(text: str) -> list[dict[str, Any]]:
    """Every event of a whole (ended) stream's body."""
    return list(parse(text.splitlines() + [""]))


def done(seen: list[dict[str, Any]]) -> bool:
    """The study completed and every array that started has ended (it may end just after)."""
    kinds = [e["event"] for e in seen]
    return "study.completed" in kinds and kinds.count("array.ended") == kinds.count("array.started")


def follow_until_done(http: httpx.Client, study_id: int) -> list[dict[str, Any]]:
    """The study's events from the first until :func:`done`; a stream that ends (the server's
    FUSETUNE_EVENTS_MAX_STREAM_S) is reopened with Last-Event-ID, as an EventSource does."""
    seen: list[dict[str, Any]] = []
    headers: dict[str, str] = {}
    while True:
        with http.stream("GET", f"/api/v1/studies/{study_id}/events", params={"after": 0}, headers=headers) as response:
            assert response.status_code == 200, response.read()
            for event in parse(response.iter_lines()):
                seen.append(event)
                if done(seen):
                    return seen
        headers = {"Last-Event-ID": seen[-1]["id"]} if seen else {}
