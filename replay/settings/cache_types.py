"""The KV cache types llama-server accepts (common/arg.cpp:304-314: kv_cache_types), by the names
`-ctk/-ctv` take, with their enum ggml_type values (ggml/include/ggml.h). One table: the settings
table's choices and the context's parameters both read it."""
from __future__ import annotations

GGML_CACHE_TYPES: dict[str, int] = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20,
                                    "q5_0": 6, "q5_1": 7}
