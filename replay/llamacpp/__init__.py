"""The real llama.cpp, outside our process: building it from pinned sources (build.py), the models
tests and demos run (models.py), starting servers (process.py), talking to them (http.py),
recording transcripts (record.py), auditing a server (audit.py), and generating and proving the
server-context.cpp fix (patches.py, patch_proof.py)."""
