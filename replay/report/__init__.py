"""Comparison -> report: what recover hands back.

    recovery.py  RecordReport and RecoverResult (summary, JSON, the one-line failure)
    repair.py    repaired copies of a transcript, same schema, placeholders filled with true values
"""
