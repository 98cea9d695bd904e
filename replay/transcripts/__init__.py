"""The files users have: every transcript layout read into read-only Records (readers.py), the
probability entries a server sent (entries.py), the generated-token plan of a record
(plan.py), our own transcript format (format.py), and safe writing (files.py)."""
