"""Comparison -> report: what recover (and trace) hand back.

    recovery.py  RecordReport and RecoverResult (summary, JSON, the short failure and its detail)
    repair.py    repaired copies of a transcript, same schema, placeholders filled with true values
    pages.py     the --html pages of a recover report or a trace (assets/: their styles and scripts)
    outputs.py   recover's --report and --html files, written whole
    schema.py    the reports' JSON (inf and nan as strings)
"""
