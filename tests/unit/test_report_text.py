"""The demo's terminal report: every value of a column starts (text) or ends (number) in line."""

from __future__ import annotations

from dflash_pipeline.dev.report_text import is_number, report_lines, table_lines
from dflash_pipeline.monitor import ui

REPORT = {
    "output_uri": "s3://dflash-demo/runs/demo",
    "validated_at": "2026-12-04T03:38:31+00:00",
    "status": "passed",
    "prompts": 2000,
    "coverage": 1.0,
    "errors_by_class": {},
    "model": "Qwen/Qwen3-8B",
    "per_server": {"http://127.0.0.1:33547": {"rows": 714, "mean_latency_s": 0.4},
                   "http://127.0.0.1:41133": {"rows": 668, "mean_latency_s": 0.41}},
    "checks": [{"name": "coverage"}],
}


def test_text_values_start_in_the_value_column_and_numbers_end_at_its_edge() -> None:
    lines = report_lines(REPORT)
    header, rule = lines[0], lines[1]
    col = header.index("value")
    edge = len(rule)
    rows = {line.split()[0]: line for line in lines[2:lines.index("")]}
    assert set(rows) == {"output_uri", "validated_at", "status", "prompts", "coverage", "errors_by_class", "model"}
    for key in ("output_uri", "validated_at", "status", "model", "errors_by_class"):
        assert rows[key].index(rows[key].split()[1]) == col, rows[key]
    assert rows["validated_at"].endswith("2026-12-04T03:38:31+00:00")
    for key in ("prompts", "coverage"):
        assert len(rows[key]) == edge, rows[key]
    assert rows["prompts"].endswith("2,000") and rows["coverage"].endswith("1.00")
    assert "checks" not in "\n".join(lines)
    servers = lines[lines.index("") + 1:]
    assert servers[0].split() == ["server", "mean_latency_s", "rows"]
    assert servers[2].split() == ["http://127.0.0.1:33547", "0.40", "714"]


def test_only_whole_numbers_count_as_numbers() -> None:
    for cell in ("2,000", "0.40", "-3", "12.5%", "714"):
        assert is_number(cell), cell
    for cell in ("2026-12-04T03:38:31+00:00", "3.11.7", "127.0.0.1:41133", "1e", "stop=2000", "-", ""):
        assert not is_number(cell), cell


def test_table_lines_have_no_trailing_blanks() -> None:
    lines = table_lines(["a", "b"], [["long text here", "x"], ["y", "1"]])
    assert all(line == line.rstrip() for line in lines)


def test_report_md_is_rendered_with_its_tables_and_escapes_html() -> None:
    md = "# dflash-pipeline report: s3://b/ds\n\n| figure | value |\n|---|---|\n| prompts | 10 |\n\n<script>x</script>\n"
    page = ui.report_page("report", md, [("back to the run", "/dflash/runs/d/r")])
    assert "<h1>dflash-pipeline report: s3://b/ds</h1>" in page
    assert "<table>" in page and "<td>prompts</td>" in page
    assert "<script>x</script>" not in page and "&lt;script&gt;" in page
    assert 'href="/dflash/runs/d/r"' in page


def test_a_long_nested_value_does_not_push_the_numbers_off_screen() -> None:
    """Issue 41: the demo's terminal report put its values about 3,000 columns to the right (a nested
    section printed as one cell widened the column every number is right-aligned in)."""
    report = {"prompts": 2000, "completions": 1998, "mix": {f"k{i}": "x" * 50 for i in range(60)},
              "quality": {"loops": {"rows": 3, "examples": ["y" * 400]}}, "status": "passed"}
    lines = report_lines(report)
    assert max(len(line) for line in lines) <= 120, max(len(line) for line in lines)
    assert any(line.startswith("prompts") and line.rstrip().endswith("2,000") for line in lines)
