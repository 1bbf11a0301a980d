"""The row type of docs/PERFORMANCE.md's tables (bench/report.py)."""

Row = tuple[str, str, str, str, str, bool | None]
"""(figure, measured, baseline, ratio, target, met)."""
