"""Evaluation -> comparison, pure: what the server sent against what the model computes.

    values.py      a token's verdict (TokenReport): its real value within tolerance, a placeholder,
                   missing, a mismatch or unaligned; the numeric bounds and their causes
    divergence.py  the rules that tell numerics from the loop where a trace parts, with the figures
    trace.py       a trace against its transcript: TraceResult, where it parts and why
"""
