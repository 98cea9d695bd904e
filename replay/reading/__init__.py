"""Transcript -> tokens, the one read stage of recover, diff and trace: everything the stages after it
need from a record, read once against the model.

    record.py      ReadRecord and read_record: the request as the server parsed it, its settings and
                   where each came from, the loop shape of its build, the generated tokens' plan, the
                   prompt ids, the context and speculative flags, what says its batches were shared
    identity.py    the transcript's evidence on its model (names, type, size) compared with -m and -md
"""
