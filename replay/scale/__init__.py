"""Recovering many records at once: on local worker processes or on a Ray cluster.

Exact recovery is one token per decode per record (batching tokens or records changes the values:
docs/numerics.md), so the way to scale is many independent evaluators, each with its own model and
context. A record can depend on the one before it (the server kept KV cells from the previous
request: timings.cache_n), so the file is cut into chains that keep such records together, and a
chain resumed in the middle is warmed up from its start; the output is then the same bytes as one
process's.

    (transcripts/chains.py says which records travel together, pure)
    worker.py   one evaluator: the model loaded once, records recovered by index
    pool.py     the driver side: units in this process or on N worker processes (--workers N)
    ray_pool.py the same work on Ray actors (--ray ADDRESS), retried when an actor dies
    journaled.py recover's JSONL run through its journal: results in file order, whatever order they
                finish in, and --resume
"""
