"""`spec-replay proxy` in front of a real speculating b11434 llama-server, used as a user uses it: started
from the command line with the server's flags, reached with the OpenAI Python SDK.

- through the proxy, every token's logprob and top_logprobs equal the patched server's for the same
  request (the values a fixed server reports: 5e-4), and the tokens are the server's own;
- sync and async, streamed and not; the seed's own request (chat, 24 tokens, temperature 1, seed 1,
  top_logprobs 3);
- the response says how many values it filled (X-Spec-Replay-Filled).
"""
from __future__ import annotations

import asyncio

import pytest
from openai import AsyncOpenAI, OpenAI
from proxy_helpers import assert_same, running_proxy, streamed, values

from replay.llamacpp.process import ServerConfig

pytestmark = [pytest.mark.build, pytest.mark.live_server, pytest.mark.model]

SEED_REQUEST = dict(model="m", messages=[{"role": "user", "content": "Write a short story about a lighthouse."}],
                    max_tokens=24, temperature=1.0, seed=1, logprobs=True, top_logprobs=3)


@pytest.fixture(scope="module")
def config(smollm2, smollm2_draft):
    """SmolLM2 Q4_1 drafted by its Q2_K requantisation (draft-simple), one slot."""
    return ServerConfig(smollm2, draft_model=smollm2_draft, spec_types=("draft-simple",))


@pytest.fixture(scope="module")
def servers(module_server, patched, config):
    """(the released b11434 server, the patched one: the truth)."""
    return module_server(config), module_server(config, binary=patched.server)


@pytest.fixture(scope="module")
def proxy(servers, config, server_cpu, tmp_path_factory):
    """`spec-replay proxy URL -m TARGET [the server's flags]` in front of the released server."""
    log = tmp_path_factory.mktemp("proxy") / "stderr.txt"
    with running_proxy(servers[0].url, [*config.args(), *server_cpu], log) as url:
        yield url


def test_the_seeds_request_through_the_proxy_has_the_patched_servers_values(proxy, servers):
    truth = OpenAI(base_url=servers[1].url + "/v1", api_key="none").chat.completions.create(**SEED_REQUEST)
    raw = OpenAI(base_url=proxy + "/v1", api_key="none").chat.completions.with_raw_response.create(**SEED_REQUEST)
    got = raw.parse()
    assert int(raw.headers["x-spec-replay-filled"]) > 0
    assert got.choices[0].message.content == truth.choices[0].message.content
    assert_same(values(got.choices[0]), values(truth.choices[0]))
    direct = OpenAI(base_url=servers[0].url + "/v1", api_key="none").chat.completions.create(**SEED_REQUEST)
    placeholders = sum(1 for c in direct.choices[0].logprobs.content if c.logprob == 0.0 and not c.top_logprobs)
    assert placeholders > 0  # what the proxy fixed: the released server's placeholders


def test_a_streamed_request_through_the_proxy_has_the_patched_servers_values(proxy, servers):
    req = {**SEED_REQUEST, "stream": True}
    truth = streamed(OpenAI(base_url=servers[1].url + "/v1", api_key="none").chat.completions.create(**req))
    got = streamed(OpenAI(base_url=proxy + "/v1", api_key="none").chat.completions.create(**req))
    assert_same(got, truth)


def test_async_clients_at_once_get_the_patched_servers_values(proxy, servers):
    async def run():
        bodies = [{**SEED_REQUEST, "seed": s} for s in (1, 2, 3, 4)]
        async with AsyncOpenAI(base_url=proxy + "/v1", api_key="none") as c:
            got = await asyncio.gather(*(c.chat.completions.create(**b) for b in bodies))
        return bodies, got
    bodies, got = asyncio.run(run())
    truth_client = OpenAI(base_url=servers[1].url + "/v1", api_key="none")
    for b, g in zip(bodies, got):
        assert_same(values(g.choices[0]), values(truth_client.chat.completions.create(**b).choices[0]))
