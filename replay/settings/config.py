"""Config objects generated from the settings table, and where each value came from.

    spec = resolve("speculative", flags={"draft_n_max": 5}, recorded=rec.flags)
    spec.draft_n_max         # 5
    spec.sources["draft_n_max"], spec.sources["spec_types"]   # "command line", "server.flags"

A value is taken from the first of: a flag given to spec-replay (spelled as llama-server spells
it), the server's own report in the /props that `record` captured (what it really runs with: a
slot's n_ctx), the flags `record` was told the server was started with (the transcript's
`server.flags`), llama-server's built-in default. Sampling settings have
more layers (the request, the model file): settings/sampling.py.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from replay.errors import SettingsError
from replay.settings.table import (BY_ATTR, BY_FLAG, CHAT_TEMPLATE_FLAGS, SETTINGS, UNREPLAYED_BY_FLAG, RecordedFlags,
                                   Setting, recorded_where, rows)

# A replay's context and threads where the server's were left to it: --ctx-size 0 (the model's
# n_ctx_train, which a replay cannot afford) with no /props n_ctx in the transcript takes the old
# server default; --threads -1 (all the server's cores) takes 2, the cores CI has. The threads of a
# one-token decode over 512 KV cells or more change its values (docs/numerics.md; thread_count), those
# of a batch do not (host_cores); the context only bounds what can be replayed.
DEFAULT_N_CTX = 2048
DEFAULT_THREADS = 2


def context_size(cfg: Any) -> int:
    """The context a replay of `cfg` (a ContextConfig) allocates.

    >>> context_size(ContextConfig()), context_size(ContextConfig(n_ctx=4096))
    (2048, 4096)
    """
    return cfg.n_ctx or DEFAULT_N_CTX


_BATCH_THREADS: list[int] = []  # set_batch_threads: a process's share of the cores, where it has one


def set_batch_threads(n: int | None) -> None:
    """This process's share of the cores for its batches (a kernel probe among others), None: all."""
    _BATCH_THREADS[:] = [n] if n else []


def core_share(workers: int) -> int:
    """Each of `workers` processes' share of this process's cores, for its batches (set_batch_threads).

    >>> core_share(10**6)
    1
    """
    return max(1, host_cores() // workers)


def host_cores() -> int:
    """The threads of the replay's batches, whose values do not depend on their thread count (a
    one-token decode's do: thread_count): the cores this process may run on, or its share of them."""
    if _BATCH_THREADS:
        return _BATCH_THREADS[0]
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def thread_count(cfg: Any) -> int:
    """The threads a replay of `cfg` decodes with.

    >>> thread_count(ContextConfig()), thread_count(ContextConfig(threads=6))
    (2, 6)
    """
    return cfg.threads if cfg.threads > 0 else DEFAULT_THREADS


def _config_class(name: str, group: str, doc: str) -> type:
    fields = [(s.attr, Any, dataclasses.field(default=s.default)) for s in rows(group)]
    fields.append(("sources", Mapping[str, str], dataclasses.field(default_factory=dict, compare=False,
                                                                    repr=False)))

    def given(self) -> dict[str, Any]:
        """The values that did not come from llama-server's defaults."""
        return {k: getattr(self, k) for k, src in self.sources.items() if src != "default"}

    cls = dataclasses.make_dataclass(name, fields, frozen=True, namespace={"given": given, "__doc__": doc})
    cls.__module__ = __name__
    return cls


SpecConfig = _config_class("SpecConfig", "speculative",
                           "The server's speculative flags (rows of the `speculative` group of settings.table).")
ContextConfig = _config_class("ContextConfig", "context",
                              "The server's context flags that change numerics or limits (`context` group).")
_CLASSES = {"speculative": SpecConfig, "context": ContextConfig}


def kv_layout(cfg: Any, recorded: Mapping[str, Any] | None = None) -> tuple[int, bool]:
    """(n_seq_max, kv_unified) of the server's context: -np auto is 4 slots on a unified cache
    (tools/server/server.cpp:168-173), --kv-unified shares one for -np N; a non-unified cache gives
    each slot its own stream, which a one-sequence context mirrors. A unified cache sizes the
    sliding-window cache for every slot (src/llama-kv-cache-iswa.cpp:73). /props reports the slot
    count, not how it was asked for: several slots without an -np among our or the recorded flags
    were -np auto's.

        >>> kv_layout(ContextConfig(n_parallel=-1)), kv_layout(ContextConfig(n_parallel=1))
        ((4, True), (1, False))
        >>> kv_layout(ContextConfig(n_parallel=4, sources={"n_parallel": "/props"}), {"--parallel": 4})
        (1, False)
    """
    n = cfg.n_parallel
    if n is None or n < 1:
        return 4, True
    if n == 1:
        return 1, False
    asked = (recorded or {}).get("--parallel") if cfg.sources.get("n_parallel") == "/props" else n
    unified = cfg.kv_unified or asked is None or asked < 1
    return (n, True) if unified else (1, False)


def longest_draft(spec: Any) -> int:
    """The longest draft the server's speculative types can make: common_speculative_n_max
    (common/speculative.cpp:2396-2427), the largest of each type's own limit.

        >>> longest_draft(SpecConfig()), longest_draft(SpecConfig(spec_types=("ngram-mod",)))
        (0, 64)
        >>> longest_draft(SpecConfig(spec_types=("draft-simple", "ngram-simple")))   # 3 and size_m 48
        48
    """
    limits = {"draft-simple": spec.draft_n_max, "draft-eagle3": spec.draft_n_max, "draft-mtp": spec.draft_n_max,
              "draft-dflash": spec.draft_n_max, "draft-dspark": spec.draft_n_max,
              "ngram-simple": spec.ngram_simple_size_m, "ngram-map-k": spec.ngram_map_k_size_m,
              "ngram-map-k4v": spec.ngram_map_k4v_size_m, "ngram-mod": spec.ngram_mod_n_max, "ngram-cache": 8}
    return max([max(0, limits.get(t, 0)) for t in spec.spec_types or ()], default=0)


HIDDEN_STATE_DRAFTERS = ("draft-mtp", "draft-eagle3", "draft-dflash", "draft-dspark")


def rollback_snapshots(spec: Any | None) -> int:
    """The recurrent-state snapshots per sequence the server asks of its target context: --spec-draft-n-max
    where a drafter that reads the target's hidden states is on, else 0 (need_n_rs_seq, common/common.h:
    399-405, set at common/common.cpp:1693). libllama keeps them only on architectures that roll back
    that way (llm_arch_supports_rs_rollback, src/llama-context.cpp:107-112: qwen35 and others), where they
    keep the last n + 1 tokens of a batch in one ubatch (src/llama-memory-hybrid.cpp:83-89) and make a
    suffix of up to n tokens removable (common_context_can_seq_rm: RS, common/common.cpp:1555-1558).

        >>> rollback_snapshots(SpecConfig(spec_types=("draft-mtp",), draft_n_max=4)), rollback_snapshots(SpecConfig())
        (4, 0)
        >>> rollback_snapshots(SpecConfig(spec_types=("draft-simple",), draft_n_max=4)), rollback_snapshots(None)
        (0, 0)
    """
    if spec is None or not any(t in HIDDEN_STATE_DRAFTERS for t in spec.spec_types or ()):
        return 0
    return max(0, spec.draft_n_max)


def draft_thread_count(spec: Any) -> int | None:
    """The draft context's thread count: --spec-draft-threads (-td) where given, else None (the target's
    -t: postprocess_cpu_params, common/arg.cpp:889, applied at common/speculative.cpp:2553-2556). A count of 0
    or less makes the server take its machine's cores (common/arg.cpp:3995-3998), which no transcript says.

        >>> draft_thread_count(SpecConfig()) is None                     # not given: the target's -t
        True
        >>> draft_thread_count(SpecConfig(draft_threads=1, sources={"draft_threads": "server.flags"}))
        1
    """
    n = spec.draft_threads
    if spec.sources.get("draft_threads", "default") == "default" or n is None:
        return None
    if n <= 0:
        raise SettingsError(f"--spec-draft-threads {n}: the server took its own machine's core count, which a "
                            "replay cannot know: give that count")
    return n


GIVEN_HERE = "given here"  # idle_cells_kept's words for a flag from our command line, not the transcript


def idle_cells_kept(cfg: Any, recorded: Mapping[str, Any] | None = None) -> str | None:
    """Why other slots' cells may have stayed in the KV cache this server decoded a request in, or None.

    On a unified cache (kv_layout) every decode's attention views the cells of all slots, masked where they
    are another slot's; where several views hold other cells, the kernels' chunks over them move values
    (measured 0.013 nats on a first entry of SmolLM2 Q4_1 behind another slot's 1,179 cells, b11434).
    By default the server saves idle slots to its prompt cache and clears them when a task starts
    (server-context.cpp:2641-2655), so a lone request's view holds its own cells only; with --cache-ram 0
    (which turns that off, server-context.cpp:1553-1557) or --no-cache-idle-slots they stay.

        >>> idle_cells_kept(ContextConfig(n_parallel=-1)) is None                      # the default: cleared
        True
        >>> idle_cells_kept(ContextConfig(n_parallel=-1, cache_ram_mib=0))
        "a 4-slot unified KV cache that keeps idle slots' cells (--cache-ram 0)"
        >>> idle_cells_kept(ContextConfig(n_parallel=4, no_cache_idle_slots=True)) is None   # a stream per slot
        True
    """
    n_seq, unified = kv_layout(cfg, recorded)
    if n_seq <= 1 or not unified:
        return None
    attr = "cache_ram_mib" if cfg.cache_ram_mib == 0 else "no_cache_idle_slots" if cfg.no_cache_idle_slots else None
    if attr is None:
        return None
    why = "--cache-ram 0" if attr == "cache_ram_mib" else "--no-cache-idle-slots"
    given = ", " + GIVEN_HERE if cfg.sources.get(attr) == "command line" else ""  # an option, not evidence
    return f"a {n_seq}-slot unified KV cache that keeps idle slots' cells ({why}{given})"


def dig(obj: Any, path: str) -> Any:
    """obj["a"]["b"] for path "a.b"; None where anything on the way is missing or not an object."""
    for part in path.split("."):
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(part)
    return obj


def resolve(group: str, *, flags: Mapping[str, Any] | None = None, recorded: Mapping[str, Any] | None = None,
            props: Mapping | None = None) -> Any:
    """The `group`'s config object, each value from the first source that has it (module docstring).
    `flags` are ours by attr; `recorded` the transcript's server flags by flag name (Record.flags).
    Values are parsed as llama-server parses its flags; a bad one raises ValueError naming the flag."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for s in rows(group):
        for src, value in (("command line", (flags or {}).get(s.attr)),
                           ("/props", dig(props, s.props) if s.props else None),
                           (recorded_where(recorded), (recorded or {}).get(s.flag))):
            value = _usable(s, s.parse(value))
            if value is not None:
                values[s.attr], sources[s.attr] = value, src
                break
        else:
            values[s.attr], sources[s.attr] = s.default, "default"
    return _CLASSES[group](**values, sources=sources)


def _usable(s: Setting, value: Any) -> Any:
    """An empty --spec-type list is no value (the server's default applies); so is a /props n_ctx of 0."""
    if value == () or (s.attr == "n_ctx" and value == 0):
        return None
    return value


# --- the transcript's record of the server's flags ------------------------------------------

def flags_block(values: Mapping[str, Any]) -> dict[str, Any]:
    """The transcript's `server.flags`: the flags a server was started with, by llama-server's
    spelling (`values` by attr; absent or None = the server's default, left out)."""
    unknown = set(values) - set(BY_ATTR)
    assert not unknown, f"not in the settings table: {unknown}"
    block: dict[str, Any] = {}
    for s in SETTINGS:
        v = s.parse(values.get(s.attr))
        if v is not None:
            block[s.flag] = list(v) if isinstance(v, tuple) else v
    return block


def recorded_flags(flags: Mapping | None, legacy: Mapping | None) -> RecordedFlags:
    """A transcript's server flags by flag name, parsed: its `server.flags`, or the older
    `server.speculative` block. Raises ValueError naming the flag for a value llama-server would
    not take, or a flag it does not know."""
    out = RecordedFlags(where="server.flags" if flags is not None or legacy is None else "server.speculative")
    if flags is not None:
        for name, value in flags.items():
            s = BY_FLAG.get(name)
            if s is None and name in UNREPLAYED_BY_FLAG:  # kept as given: unreplayed() judges it per command
                out[UNREPLAYED_BY_FLAG[name].name] = value
                continue
            if s is None and name in CHAT_TEMPLATE_FLAGS:  # judged where a chat prompt is rebuilt
                out[name] = value
                continue
            if s is None:
                raise ValueError(f"\"server.flags\": {name!r} is not a llama-server flag spec-replay knows")
            out[s.flag] = s.parse(value)
        return out
    for s in SETTINGS:
        value = dig(legacy, s.transcript) if s.transcript else None
        if value is not None:
            out[s.flag] = s.parse(value)
    return out


def check_props(props: Mapping | None) -> None:
    """Raise ValueError (naming the field) for a /props value llama-server could not have reported:
    the context rows' values and the sampling defaults in default_generation_settings.params."""
    params = dig(props, "default_generation_settings.params")
    if params is not None and not isinstance(params, Mapping):
        raise ValueError("\"server.props.default_generation_settings.params\" must be an object")
    for s in SETTINGS:
        paths = [s.props] if s.props else []
        if s.group == "sampling" and s.generation:
            paths.append(f"default_generation_settings.params.{s.generation}")
        for path in paths:
            value = dig(props, path)
            try:
                if s.attr == "samplers" and value is not None:
                    if not (isinstance(value, list) and all(isinstance(x, str) for x in value)):
                        raise ValueError("must be a list of sampler names")
                elif s.kind in ("strings",) and value is not None and not isinstance(value, list):
                    raise ValueError("must be a list")
                else:
                    s.parse(value)
            except ValueError as e:
                raise ValueError(f"\"server.props.{path}\": {e}") from e


def describe(config: Any) -> list[tuple[str, Any, str]]:
    """(flag, value, source) for every value of a config object, in table order."""
    return [(BY_ATTR[f.name].flag, getattr(config, f.name), config.sources.get(f.name, "default"))
            for f in dataclasses.fields(config) if f.name != "sources"]
