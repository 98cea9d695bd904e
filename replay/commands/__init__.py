"""The features, each a pipeline over the layers below (cli/ is their thin I/O):

    recover.py        recover: transcript -> tokens -> evaluation -> comparison -> report (the API:
                      `recover`, `recover_records`, `Recoverer`)
    trace.py          trace: a record (or a prompt) through the speculative loop (loop/) with its
                      settings, checked token by token against the transcript
    trace_state.py    what a server keeps across requests, per slot
    probe.py          which CPU kernels computed a transcript: its first real entry under each
                      variant, one process per variant (a process holds one ggml)
    kernel_choice.py  the variant that reproduces the server, or a one-line refusal (pure)
    record.py         record a transcript from a live server (verbose echo, /props, /slots)
    audit.py          check: what a live server does with logprobs while it speculates
"""
