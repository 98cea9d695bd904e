"""Which CPU kernels computed a transcript, found by evaluating its first real entry under each
candidate this host runs (a release-style libllama's variants, with and without repack):

    types.py      the values passed around: ProbeJob, Candidate, Outcome, Witnessed, Probe (pure data)
    choice.py     the witnesses, and the variant that reproduces the server or a one-line refusal (pure)
    classes.py    which candidates compute a model alike, learnt from the probes (pure, but for the keys)
    cache.py      probe results and classes kept under the cache root
    processes.py  the probes, one process per variant (a process holds one ggml)
    policy.py     the candidates (--server-cpu, --no-repack, what runs here) and the choice among them
"""
