"""spec-replay: tell the truth about llama.cpp's speculative decoding.

    import replay
    res = replay.recover("run.json", model="target.gguf", flags={"--ctx-size": 4096})   # run/recover.py
    steps = replay.trace("run.json", model="target.gguf", flags={"-md": "draft.gguf"})  # run/trace.py
    runs = replay.tune("run.json", "target.gguf", ["--spec-draft-n-max=2,8"], flags={"-md": "draft.gguf"})

Each starts as the command line's run does (replay/run/: the inputs checked, the libllama and CPU kernels
chosen) and gives the same report.

Server flags are spelled as llama-server spells them (settings/server_flags.py); reports are described
field by field in docs/report-format.md.
"""
from replay.version import __version__  # noqa: F401  (the bottom layer holds it)


def __getattr__(name):  # lazy: importing the package must not load libllama
    if name == "recover":
        from replay.run.recover import recover
        return recover
    if name == "trace":
        from replay.run.trace import trace
        return trace
    if name == "tune":
        from replay.run.tune import tune
        return tune
    raise AttributeError(name)
