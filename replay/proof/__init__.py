"""The proof harness: evidence about llama.cpp itself, built on the commands.

    patches.py        the server-context.cpp fix, generated for a tree
    patch_proof.py    patch --verify: a patched server's values against the replay
    matrix.py         one build of the build matrix (bench/matrix.json, README)
    distribution.py   dist: which speculative loops keep the target's distribution
    example_loop.py   llama-speculative's loop, reimplemented (it changes the distribution at t > 0)
"""
