"""trace: a recorded request (or a fresh prompt) run through the server's loop (loop/) with its
settings, and checked token by token against what the server sent (run.py)."""
