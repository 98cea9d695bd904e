"""spec-replay: tell the truth about llama.cpp's speculative decoding.

    import replay
    res = replay.recover("run.json", model="target.gguf", flags={"--ctx-size": 4096})   # run/recover.py
    steps = replay.trace("run.json", model="target.gguf", flags={"-md": "draft.gguf"})  # run/trace.py
    runs = replay.tune("run.json", "target.gguf", ["--spec-draft-n-max=2,8"], flags={"-md": "draft.gguf"})

`dir(replay)` lists the public names; docs/python-api.md documents each. Each call starts as the command
line's run does (replay/run/: the inputs checked, the libllama and CPU kernels
chosen) and gives the same report.

Server flags are spelled as llama-server spells them (settings/server_flags.py); reports are described
field by field in docs/report-format.md.
"""
from replay.version import __version__  # noqa: F401  (the bottom layer holds it)

# the public names (docs/python-api.md), imported when first used: importing the package loads no libllama
_PUBLIC = {
    "recover": "replay.run.recover",
    "trace": "replay.run.trace",
    "tune": "replay.run.tune",
    "RecoverOptions": "replay.commands.recovering.options",
    "RecoverResult": "replay.report.recovery",
    "SpecReplayError": "replay.errors",
    "Exit": "replay.errors",
}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'replay' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
