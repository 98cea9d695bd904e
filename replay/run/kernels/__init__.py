"""Which CPU kernels computed a transcript, decided from its evidence as one pipeline, read top to bottom
in policy.py choose_kernels (the build, where the transcript names none, is decided the same way, build
by build: run/build_choice.py):

    candidates  the variants the libllama holds that this CPU runs and whose kernels run here
                (runtime/health.py), with the repack modes the flags leave open     policy.candidates_in
    answers     the user's: --server-cpu (a variant, or the machine as its user
                knows it: runtime/server_cpu.py), -nr, --server-backend            policy.given_variant
    evidence    the witnesses' first real entries under each class of candidates,  choice.witnesses,
                best first; the server's later real entries; where no entry tells, processes.probe_variants,
                the server's loop replayed under each class (its tokens and draft  processes.loop_parted,
                totals)                                                            policy._probed, _by_loop
    decision    the class that computed them with its reasons, or one line saying  choice.choose_variant,
                why none did and what to give                                       choice.told_by_loop
    numerics    the KernelChoice that is the report's numerics.cpu                 runtime/engine.py

Below the pipeline:

    types.py      the values passed around: ProbeJob, Candidate, Outcome, Witnessed, Probe (pure data)
    classes.py    which candidates compute a model alike, learnt from the probes (pure, but for the keys)
    cache.py      probe results and classes kept under the cache root
    processes.py  the probes, one process per variant (a process holds one ggml)
"""
