"""The real llama.cpp, outside our process: building it from pinned sources (build.py, native/ for
our helper programs built inside its tree), the models tests and demos run (models.py), starting
servers (process.py), talking to them (http.py), which libllama replays a build (libllama.py), and
the server's own request parsing run through our helper (server_request.py)."""
