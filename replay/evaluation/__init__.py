"""Tokens -> model evaluation for recover: the target's true values for every generated token.

    walk.py   one decode per token after the prompt, in the server's prompt batches and slot memory
              (schedule/), producing a Truth per token: the truth this project reports (docs/
              architecture.md says why this schedule)

The speculative loop itself (loop/) is the other evaluation: trace runs it to reproduce what the
server drafted and accepted.
"""
