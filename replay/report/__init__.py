"""Comparison -> report: what recover (and trace) hand back.

    recovery.py  RecordReport and RecoverResult (summary, JSON, the short failure and its detail);
                 recover's --report file, written whole
    repair.py    repaired copies of a transcript, same schema, placeholders filled with true values
    pages.py     the --html pages of a recover report or a trace (assets/: their styles and scripts);
                 recover's --html file, written whole
    schema.py    the reports' JSON (inf and nan as strings)
"""
