"""llama-server's speculative loop and its math, reproduced step by step in-process.

    loop.py         SpeculativeLoop: the driver, prefill, then draft / decode / verify / trim / emit per step
    request.py      Request (what a request brings), Step (what a step did), the seed rule
    drafting.py     which drafters draft, a step's draft length, which drafter's draft wins, pure
    drafters.py     the n-gram drafters and the table that builds every drafter from the flags
    draft_model.py  draft-simple: the draft model's context and sampler
    draft_mtp.py    draft-mtp: the MTP heads' context and its catch-up on each verify batch
    verifiers.py    sample-and-match, rejection and a restored step's replay, over the verify batch's rows
    verify.py       the rules at one position (match, rejection), pure
    emission.py     the emitted tokens with their verify-row values, and the stop rules, pure
    expectation.py  the verifier's acceptance probabilities along a draft (tune)
    state.py        what a slot and the server keep across requests
    replayable.py   what a loop shape can replay (the shapes: builds/loop_shapes.py)
    work.py         the generation phase's decodes and chain passes, for the speed model

The slot's memory operations in a step (checkpoint, trim, restore) are schedule/step_memory.py, beside
the prompt phase's schedule/memory.py.
"""
