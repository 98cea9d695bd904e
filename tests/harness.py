"""An eval harness as users run one: the async OpenAI SDK sending chat requests at once to a llama-server
started with default flags (4 slots, a unified KV cache), each response dumped with model_dump() beside
its request, one JSON line per request (a JSONL `recover` reads). Used by tests/test_identity.py and
bench/identity.py."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

TOPICS = ("the sea", "a lighthouse", "bread", "winter", "a violin", "the moon", "rivers", "a clock")


def body(k: int, max_tokens: int = 48) -> dict:
    return {"model": "any", "messages": [{"role": "user", "content": f"Write two sentences about {TOPICS[k % 8]}."}],
            "max_tokens": max_tokens, "temperature": 1.0, "logprobs": True, "top_logprobs": 3, "seed": 100 + k}


def run_harness(url: str, out: Path, *, n: int = 8, concurrent: bool = True, max_tokens: int = 48) -> Path:
    """Send `n` chat requests (all at once, or one after another) and write their JSONL to `out`."""
    from openai import AsyncOpenAI

    async def main() -> list[dict]:
        client = AsyncOpenAI(base_url=url + "/v1", api_key="none")

        async def one(k: int) -> dict:
            b = body(k, max_tokens)
            r = await client.chat.completions.create(**b)
            return {"request": b, "response": r.model_dump()}
        try:
            if concurrent:
                return list(await asyncio.gather(*[one(k) for k in range(n)]))
            return [await one(k) for k in range(n)]
        finally:
            await client.close()
    rows = asyncio.run(main())
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out
