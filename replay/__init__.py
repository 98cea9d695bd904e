"""spec-replay: tell the truth about llama.cpp's speculative decoding.

    import replay
    res = replay.recover("run.json", model="target.gguf", flags={"--ctx-size": 4096})   # commands/recover.py
    steps = replay.trace("run.json", model="target.gguf", flags={"-md": "draft.gguf"})  # commands/trace.py

Server flags are spelled as llama-server spells them (settings/server_flags.py); reports are described
field by field in docs/report-format.md.
"""
from replay.version import __version__  # noqa: F401  (the bottom layer holds it)


def __getattr__(name):  # lazy: importing the package must not load libllama
    if name == "recover":
        from replay.commands.recover import recover
        return recover
    if name == "trace":
        from replay.commands.trace import trace
        return trace
    raise AttributeError(name)
