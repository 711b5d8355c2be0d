"""The fault matrix of docs/reliability.md, from what the fault tests measured.

Each fault test writes its row to ``build/reliability/<fault>.json`` (tests/faults.py). This
script gathers the rows into ``docs/reliability.json`` and rewrites the table between the
``<!-- matrix -->`` markers of docs/reliability.md:

    .venv/bin/python -m pytest -m slow tests/test_faults.py tests/test_restart.py tests/test_cluster.py
    .venv/bin/python benchmarks/reliability_table.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- matrix -->", "<!-- /matrix -->"


def table(rows: list[dict]) -> str:
    lines = [
        "| fault | trials × epochs | points lost | points duplicated | trials failed | epochs retrained | time to recover | resumed at epoch | measured by |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        resumed = r.get("resumed_at_epochs") or {}
        at = ", ".join(str(v[0] if isinstance(v, list) else v) for _, v in sorted(resumed.items(), key=lambda kv: int(kv[0]))) or "—"
        recover = f"{r['recover_s']:.1f} s" if r.get("recover_s") is not None else "—"
        lines.append(
            f"| {r['fault']} | {r.get('trials', '?')} × {r.get('epochs', '?')} | {r['points_lost']} | {r['points_duplicated']} "
            f"| {r.get('trials_failed', '—')} | {r['epochs_retrained']} | {recover} | {at} | {r.get('how', '')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=ROOT / "build" / "reliability")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "reliability.md")
    args = parser.parse_args()
    rows = sorted((json.loads(p.read_text()) for p in args.results.glob("*.json")), key=lambda r: r["fault"])
    (args.doc.parent / "reliability.json").write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    text = args.doc.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    args.doc.write_text(f"{head}{BEGIN}\n{table(rows)}\n{END}{tail}")
    print(table(rows))


if __name__ == "__main__":
    main()
