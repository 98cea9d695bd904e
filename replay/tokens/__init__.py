"""Transcript -> tokens: the prompt ids a server evaluated for a record.

    prompt_ids.py   the prompt's ids (the transcript's own, the server's tokenization of its text, or
                    a chat rendered as the server renders it) and where its user messages start
    server_view.py  the request as the server parsed it (grammar, chat prompt, stops), from our
                    spec-replay-request helper built inside the llama.cpp tree, when the transcript
                    lacks the server's echo
"""
