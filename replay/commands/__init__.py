"""The features, each a pipeline over the layers below, for one record after another (a run over a file
starts at the front door above them, run/; cli/ is the thin I/O over that):

    recover.py        recover: transcript -> tokens -> evaluation -> comparison -> report (`Recoverer`,
                      `RecoverOptions`, `result_of`)
    trace.py          trace: a record (or a prompt) through the speculative loop (loop/) with its
                      settings, checked token by token against the transcript
    trace_state.py    what a server keeps across requests, per slot, and which records it ties together
    tune.py           a record's traffic under other speculative settings: the sweep's runs and costs
    record.py         record a transcript from a live server (verbose echo, /props, /slots)
    check.py          check: what a live server does with logprobs while it speculates
"""
