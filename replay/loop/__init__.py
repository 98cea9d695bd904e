"""llama-server's speculative loop and its math, reproduced step by step in-process.

    loop.py         SpeculativeLoop: prefill, then draft / decode / verify / trim / emit per step
    verify.py       the two verification rules (sample-and-match, rejection), pure
    drafters.py     the n-gram drafters and the table that builds every drafter from the flags
    draft_model.py  draft-simple: the draft model's context and sampler
    replayable.py   what a loop shape can replay (the shapes: builds/loop_shapes.py)
"""
