"""spec-replay: tell the truth about llama.cpp's speculative decoding.

    import replay
    res = replay.recover("run.json", model="target.gguf")   # see replay.commands.recover
"""
__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing the package must not load libllama
    if name == "recover":
        from replay.commands.recover import recover
        return recover
    raise AttributeError(name)
