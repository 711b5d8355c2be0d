"""Reading server-sent events in tests: the wire format, parsed as an EventSource would."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any


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
