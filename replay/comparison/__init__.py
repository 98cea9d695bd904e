"""Evaluation -> comparison, pure: what the server sent against what the model computes.

    values.py      a token's verdict (TokenReport): its real value within tolerance, a placeholder,
                   missing, a mismatch or unaligned; the numeric bounds and their causes
    divergence.py  where a trace parts from its transcript, numerics or the loop, with the figures
"""
