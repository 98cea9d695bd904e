"""The server's decode schedule for a request's prompt, where it depends on the model's memory.

    prompt.py   the batch cuts and checkpoint decisions of llama-server's prompt phase, and what a
                new request keeps of a slot's memory (plan_reuse), pure
    spans.py    where a chat prompt's user messages start (the chat autoparser's delimiters), pure
    prefix.py   what a record keeps of the KV the record before it left (the server's cache_n), pure
    memory.py   SlotMemory: a slot's contexts and checkpoints in-process, running those decisions
    step_memory.py  the slot's memory through a speculative step: checkpoint, trim, restore
"""
