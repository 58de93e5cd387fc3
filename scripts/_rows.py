"""What the scripts share: a table of result rows printed one line each and written as CSV.

Imported by its siblings as ``from _rows import report_rows`` (a script's own directory is first
on ``sys.path`` when it runs; ``tests/load.py`` does the same when a test loads one)."""

from __future__ import annotations

import csv
from pathlib import Path


def report_rows(rows: list[dict], out: Path | None) -> None:
    """Print each row as ``key=value, ...``; with ``out``, write the rows to that CSV (its columns
    are the first row's keys; parent directories are made)."""
    for row in rows:
        print(", ".join(f"{k}={v}" for k, v in row.items()))
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
