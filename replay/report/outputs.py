"""recover's report files: the --report JSON and the --html page, each written whole or not at all
(transcripts/files.py write_atomic)."""
from __future__ import annotations

from replay.report import schema as report_json
from replay.report.pages import recover_page
from replay.report.recovery import RecoverResult
from replay.transcripts.files import write_atomic


def write_report(report_file: str | None, res: RecoverResult, force: bool) -> bool:
    """--report: the report as JSON (docs/report-format.md); whether a file was written."""
    if report_file:
        write_atomic(report_file, report_json.dumps(res.to_json(), indent=2) + "\n", force=force)
    return bool(report_file)


def write_page(html_file: str | None, res: RecoverResult, force: bool) -> bool:
    """--html: the report as one self-contained page (pages.py); whether a file was written."""
    if html_file:
        write_atomic(html_file, recover_page(res), force=force)
    return bool(html_file)
