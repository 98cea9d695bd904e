"""llama-server's settings: one declarative table (table.py) and the config objects and
resolution rules generated from it (config.py; sampling.py for the sampling settings of a
request). Owns every spelling of a server flag."""
from replay.settings.config import (
    ContextConfig,
    SpecConfig,
    check_props,
    describe,
    draft_thread_count,
    flags_block,
    idle_cells_kept,
    kv_layout,
    longest_draft,
    recorded_flags,
    resolve,
)
from replay.settings.table import BY_ATTR, BY_FLAG, SETTINGS, Setting, rows

__all__ = ["BY_ATTR", "BY_FLAG", "SETTINGS", "ContextConfig", "Setting", "SpecConfig", "check_props",
           "describe", "draft_thread_count", "flags_block", "idle_cells_kept", "longest_draft", "recorded_flags",
           "resolve", "rows"]
