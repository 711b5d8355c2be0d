"""What the CLI writes to a terminal: a tenant's text, inert.

``fusetune status``, ``tenants tokens`` and the rest print what tenants wrote (params, study
names, token labels, errors, warnings). A terminal acts on control characters in it: an escape
sequence can retitle the admin's window, clear the screen and fake output, or (OSC 52) write
their clipboard. :class:`Inert` wraps the CLI's stdout and stderr, and writes every control
character but newline and tab, and the bidirectional overrides, as a visible escape.
"""

from __future__ import annotations

from typing import Any, TextIO

__all__ = ["Inert"]

_VISIBLE: dict[int, str] = {
    **{c: f"\\x{c:02x}" for c in range(0x20) if chr(c) not in "\n\t"},
    0x7F: "\\x7f",
    **{c: f"\\x{c:02x}" for c in range(0x80, 0xA0)},  # C1: ESC's one-byte forms (CSI, OSC, ...)
    # Bidirectional embeddings, overrides and isolates: text that displays as other text.
    **{c: f"\\u{c:04x}" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))},
}


class Inert:
    """A text stream that writes control characters as visible escapes (see the module docstring)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(text.translate(_VISIBLE))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
