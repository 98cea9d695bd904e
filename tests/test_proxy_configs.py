"""`spec-replay proxy` in front of real b11434 servers configured as users run them, reached with the OpenAI
Python SDK as an eval harness reaches them; the truth is the same build patched by `spec-replay patch`,
sent the same requests in the same order, one at a time.

- Default flags (4 slots, a unified KV cache), prompts of over 1,000 tokens sharing a prefix (the server
  reuses its prompt cache), the server's -t not told to the proxy, draft-simple:
  - four clients at once through the proxy: their requests shared the server's batches, and each response
    says so (HTTP 500 naming the evidence) instead of passing off a value;
  - the same four through `--serial`: every value is the patched server's (5e-4);
  - a client that goes away while its replay runs: the worker running it is terminated, the next request
    is filled;
  - SIGTERM while a replay runs: the request held is answered, then the proxy exits 0.
- ngram-mod (its table kept across requests, server-wide) and MTP heads (draft-mtp: the heads' carry kept
  across requests): requests in turn, sync and whole then async and streamed, each the patched server's
  values; the proxy replays what the server kept from one to the next. ngram-mod's chat streams too,
  whose speculative chunks carry text and no ids.
- Gemma 3 (sliding-window attention: a target that cannot drop a suffix, so the server's loop is replayed),
  default flags: the patched server's values.
- Sampling defaults from the model file and a sampling flag on the server's command line, requests that
  set only a temperature: the patched server's values.
- A server on another machine's kernels (haswell only), the proxy told nothing of its CPU: the kernels are
  found from the first response's evidence, and the values are the patched haswell server's.
"""
from __future__ import annotations

import asyncio
import json
import signal
import urllib.error
import urllib.request

import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from proxy_helpers import (assert_same, completion_values, native_values, running_proxy, streamed, values,
                           workers_of)

from replay.llamacpp.models import smollm2_with_defaults
from replay.llamacpp.process import LlamaServer, ServerConfig
from replay.paths import FIXTURES

pytestmark = [pytest.mark.build, pytest.mark.live_server, pytest.mark.model]

STORY = ("The lighthouse keeper climbed the stairs every night at nine, lit the lamp, and wrote the weather "
         "in his book. ") * 45


def long_chat(seed: int) -> dict:
    """A chat request of about 1,100 prompt tokens, as a harness sends it."""
    return dict(model="m", messages=[{"role": "user", "content": STORY + "Retell the story in one line."}],
                max_tokens=24, temperature=1.0, seed=seed, logprobs=True, top_logprobs=3)


# --- default flags ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_flags(smollm2, smollm2_draft):
    """SmolLM2 Q4_1 drafted by its Q2_K requantisation, llama-server's default slots (-np -1: 4, unified
    KV), one thread (-t 1, which the proxy is not told)."""
    return ServerConfig(smollm2, n_parallel=-1, n_ctx=8192, threads=1, draft_model=smollm2_draft,
                        spec_types=("draft-simple",))


@pytest.fixture(scope="module")
def default_servers(module_server, patched, default_flags):
    return module_server(default_flags), module_server(default_flags, binary=patched.server)


def proxy_args(cfg: ServerConfig, *extra: str) -> list[str]:
    """What a user who runs default flags tells the proxy: the models, the drafter, the context size."""
    return ["-m", cfg.model, "-md", cfg.get("draft_model"), "--spec-type", "draft-simple", "-c", cfg.get("n_ctx"),
            *extra]


async def at_once(url: str, bodies: list[dict]) -> list:
    async with AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600) as c:
        return await asyncio.gather(*(c.chat.completions.create(**b) for b in bodies), return_exceptions=True)


def test_clients_at_once_on_a_default_flag_server_are_told_their_batches_were_shared(
        default_servers, default_flags, server_cpu, tmp_path):
    with running_proxy(default_servers[0].url, proxy_args(default_flags, *server_cpu), tmp_path / "log") as url:
        got = asyncio.run(at_once(url, [long_chat(s) for s in (1, 2, 3, 4)]))
    for g in got:
        assert isinstance(g, openai.InternalServerError), g
        message = g.body["message"] if isinstance(g.body, dict) else str(g)
        assert "the values are approximate" in message and "other request" in message, message
        assert "\n" not in message


@pytest.fixture(scope="module")
def serial_servers(module_server, patched, default_flags):
    """Fresh servers: a prompt cache left by requests the proxy did not send is not the proxy's to know
    (such a response is refused: the first entry then disagrees)."""
    return module_server(default_flags), module_server(default_flags, binary=patched.server)


@pytest.fixture(scope="module")
def serial_proxy(serial_servers, default_flags, server_cpu, tmp_path_factory):
    """(its URL, its stderr, its pid)"""
    log, pids = tmp_path_factory.mktemp("serial") / "stderr.txt", []
    with running_proxy(serial_servers[0].url, proxy_args(default_flags, "--serial", *server_cpu), log, pids) as url:
        yield url, log, pids[0].pid


def test_through_serial_clients_at_once_get_the_patched_servers_values(serial_servers, serial_proxy):
    url, _, _ = serial_proxy
    bodies = [long_chat(s) for s in (1, 2, 3, 4)]
    got = asyncio.run(at_once(url, bodies))
    assert all(not isinstance(g, Exception) for g in got), [str(g) for g in got if isinstance(g, Exception)]
    truth = OpenAI(base_url=serial_servers[1].url + "/v1", api_key="none")
    for b, g in zip(bodies, got):
        assert g.usage.prompt_tokens > 1000
        assert_same(values(g.choices[0]), values(truth.chat.completions.create(**b).choices[0]))


def test_a_client_that_goes_away_has_its_running_replay_stopped(default_servers, default_flags, server_cpu, tmp_path):
    log, pids = tmp_path / "stderr.txt", []
    # no prompt cache: what the other proxy's requests left in the slots is not this proxy's to know
    short = dict(long_chat(8), messages=[{"role": "user", "content": "Name three colours of the sea."}],
                 extra_body={"cache_prompt": False})
    with running_proxy(default_servers[0].url, proxy_args(default_flags, "--serial", *server_cpu), log, pids) as url:
        client = OpenAI(base_url=url + "/v1", api_key="none")
        assert int(client.chat.completions.with_raw_response.create(**short).headers["x-spec-replay-filled"]) > 0
        pid = pids[0].pid
        before = set(workers_of(pid))  # the worker, its models loaded

        async def run() -> bool:
            async with AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as c:
                task = asyncio.ensure_future(c.chat.completions.create(**long_chat(7)))
                for _ in range(1200):
                    await asyncio.sleep(0.05)
                    if "R" in workers_of(pid).values():  # a worker is computing: the server has answered
                        break
                else:
                    return False
                await asyncio.sleep(0.2)
                task.cancel()  # the client goes away mid-replay
                for _ in range(200):  # pebble terminates the worker (SIGTERM, then SIGKILL after 3 s)
                    await asyncio.sleep(0.05)
                    if not before & set(workers_of(pid)):
                        break
                return True
        assert before and asyncio.run(run())
        assert "the client went away; its replay was cancelled" in log.read_text()
        assert not before & set(workers_of(pid))  # the worker that was replaying was terminated
        again = client.chat.completions.with_raw_response.create(**dict(short, seed=9))
        assert int(again.headers["x-spec-replay-filled"]) > 0  # by a fresh worker


def test_a_proxy_stopped_mid_replay_answers_the_request_it_holds_then_exits(default_servers, default_flags,
                                                                              server_cpu, tmp_path):
    """SIGTERM (a service manager's stop): no new connections, the request held is answered, then the workers
    stop and the proxy exits 0."""
    log, procs = tmp_path / "stderr.txt", []
    short = dict(long_chat(8), messages=[{"role": "user", "content": "Name three colours of the sea."}],
                 extra_body={"cache_prompt": False})
    with running_proxy(default_servers[0].url, proxy_args(default_flags, *server_cpu), log, procs) as url:
        proc = procs[0]

        async def run():
            async with AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600) as c:
                task = asyncio.ensure_future(c.chat.completions.with_raw_response.create(**short))
                for _ in range(2400):
                    await asyncio.sleep(0.05)
                    if "R" in workers_of(proc.pid).values():  # its replay runs (the worker choosing its engine)
                        break
                proc.send_signal(signal.SIGTERM)
                return await task
        answered = asyncio.run(run())
        assert answered.status_code == 200 and int(answered.headers["x-spec-replay-filled"]) > 0
        assert proc.wait(timeout=90) == 0


# --- drafters that keep state across requests; a checkpointing target ----------------------------------

def native(url: str, body: dict) -> tuple[dict, dict]:
    """POST /completion: (the response's headers, its body)."""
    req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=900) as r:
            return {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    except urllib.error.HTTPError as e:
        pytest.fail(f"HTTP {e.code}: {e.read().decode()}")


def completion(prompt: str, n_predict: int, n_probs: int, **sampling) -> dict:
    """An OpenAI SDK `completions.create` request; what the SDK does not name goes in extra_body."""
    named = {k: sampling.pop(k) for k in ("temperature", "seed") if k in sampling}
    return dict(model="m", prompt=prompt, max_tokens=n_predict, logprobs=n_probs, **named, extra_body=sampling)


def sdk_in_turn(url: str, bodies: list[dict]) -> list[tuple[int, list, dict]]:
    """`bodies` one after another to /v1/completions with the OpenAI SDK, as a harness sends them: the even
    ones sync and whole, the odd ones async and streamed. [(X-Spec-Replay-Filled, values, timings)]"""
    out = []
    for i, b in enumerate(bodies):
        if i % 2 == 0:
            raw = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900) \
                .completions.with_raw_response.create(**b)
            got = raw.parse()
            out.append((int(raw.headers["x-spec-replay-filled"]), completion_values(got.choices),
                        got.model_extra.get("timings", {})))
        else:
            out.append(asyncio.run(_streamed_completion(url, b)))
    return out


async def _streamed_completion(url: str, body: dict) -> tuple[int, list, dict]:
    async with AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900) as c:
        raw = await c.completions.with_raw_response.create(**body, stream=True)
        chunks = [ch async for ch in raw.parse()]
    timings = next((ch.model_extra["timings"] for ch in reversed(chunks) if ch.model_extra.get("timings")), {})
    return int(raw.headers["x-spec-replay-filled"]), completion_values(c for ch in chunks for c in ch.choices), timings


def in_turn(module_server, patched, cfg: ServerConfig, args: list, bodies: list[dict], log) -> None:
    """`bodies` one after another through the proxy in front of a released server with the OpenAI SDK (sync,
    then async and streamed, in turn), and to a patched one: the tokens and every value the same, and the
    server speculated."""
    plain, truth = module_server(cfg), module_server(cfg, binary=patched.server)
    with running_proxy(plain.url, args, log) as url:
        got = sdk_in_turn(url, bodies)
    client = OpenAI(base_url=truth.url + "/v1", api_key="none", max_retries=0, timeout=900)
    want = [completion_values(client.completions.create(**b).choices) for b in bodies]
    assert sum(t.get("draft_n", 0) for _, _, t in got) > 0
    for (filled, g, _), w in zip(got, want):
        assert filled > 0
        assert_same(g, w)


def test_ngram_mod_requests_in_turn_get_the_patched_servers_values(module_server, patched, smollm2, server_cpu,
                                                                   tmp_path):
    cfg = ServerConfig(smollm2, spec_types=("ngram-mod",))
    # the story cut mid-sentence: the model goes on repeating it, which the n-gram table drafts
    bodies = [completion(STORY[:n], 64, 3, temperature=0.0, cache_prompt=False)
              for n in (600, 1700)]  # the second past 256 positions: the loop's values, from the table
    in_turn(module_server, patched, cfg, ["-m", smollm2, "--spec-type", "ngram-mod", "-np", 1, *server_cpu],
            bodies, tmp_path / "log")


def test_ngram_mod_chat_streams_in_turn_get_the_patched_servers_values(module_server, patched, smollm2, server_cpu,
                                                                     tmp_path):
    """A chat stream's speculative chunks carry text and no ids; past 256 positions ngram-mod's verify
    batches reach 64 rows, so the proxy replays the server's loop over the table the server kept from the
    request before, and matches the loop's tokens to each chunk's text."""
    cfg = ServerConfig(smollm2, spec_types=("ngram-mod",))
    bodies = [dict(model="m", messages=[{"role": "user", "content": STORY[:n] + " Repeat the story exactly."}],
                   max_tokens=64, temperature=0.0, seed=1, logprobs=True, top_logprobs=3,
                   extra_body={"cache_prompt": False}) for n in (600, 1700)]
    plain, truth = module_server(cfg), module_server(cfg, binary=patched.server)

    async def through(url: str) -> list:
        async with AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900) as c:
            return [streamed([ch async for ch in await c.chat.completions.create(**b, stream=True)]) for b in bodies]
    with running_proxy(plain.url, ["-m", smollm2, "--spec-type", "ngram-mod", "-np", 1, *server_cpu],
                       tmp_path / "log") as url:
        got = asyncio.run(through(url))
    client = OpenAI(base_url=truth.url + "/v1", api_key="none", max_retries=0, timeout=900)
    for g, b in zip(got, bodies):
        assert_same(g, values(client.chat.completions.create(**b).choices[0]))


def test_mtp_heads_requests_in_turn_get_the_patched_servers_values(module_server, patched, server_cpu, tmp_path):
    model = FIXTURES / "tiny-hyv3-q8_0-mtp1.gguf"
    cfg = ServerConfig(model, n_ctx=256, spec_types=("draft-mtp",))
    bodies = [completion(p, 48, 2, temperature=1.0, seed=3, ignore_eos=True)
              for p in ("hello world the", "The quick brown fox")]
    in_turn(module_server, patched, cfg, ["-m", model, "--spec-type", "draft-mtp", "-c", 256, "-np", 1, *server_cpu],
            bodies, tmp_path / "log")


def test_gemma3_on_default_flags_gets_the_patched_servers_values(module_server, patched, gemma3, gemma3_draft,
                                                                 server_cpu, tmp_path):
    cfg = ServerConfig(gemma3, n_parallel=-1, n_ctx=4096, draft_model=gemma3_draft, spec_types=("draft-simple",))
    bodies = [completion(STORY[:1200] + "Retell it.", 32, 3, temperature=1.0, seed=2)]
    in_turn(module_server, patched, cfg, ["-m", gemma3, "-md", gemma3_draft, "--spec-type", "draft-simple",
                                          "-c", 4096, *server_cpu], bodies, tmp_path / "log")


def test_sampling_defaults_from_the_model_file_and_the_command_line_get_the_patched_servers_values(
        module_server, patched, smollm2_draft, server_cpu, tmp_path):
    """A model file that carries general.sampling.* defaults (top-k, top-p, repeat penalty: SMOLLM2_FILE_DEFAULTS)
    and a sampling flag on the server's command line (--min-p 0.02), told to the proxy as the server was
    started; the clients send only a temperature and a seed, as a harness does."""
    model = smollm2_with_defaults()
    cfg = ServerConfig(model, draft_model=smollm2_draft, spec_types=("draft-simple",), min_p=0.02)
    bodies = [completion(STORY[:400] + "Then", 40, 3, temperature=1.0, seed=s) for s in (4, 5)]
    in_turn(module_server, patched, cfg, ["-m", model, "-md", smollm2_draft, "--spec-type", "draft-simple",
                                          "--min-p", "0.02", "-np", 1, *server_cpu], bodies, tmp_path / "log")


# --- a server on another machine's kernels ------------------------------------------------------------

def test_a_server_on_another_machines_kernels_is_found_from_its_first_response(b11434, patched, smollm2,
                                                                               smollm2_draft, tmp_path):
    """A server that loads only libggml-cpu-haswell.so (what a release server loads on an AVX2 machine) and a
    proxy told nothing of its CPU: the engine is chosen from the first response's real entry, as recover
    chooses it, and the values are the patched haswell server's."""
    cfg = ServerConfig(smollm2, draft_model=smollm2_draft, spec_types=("draft-simple",))
    bodies = [{"prompt": STORY[:1300] + "Retell it.", "n_predict": 32, "n_probs": 3, "temperature": 1.0, "seed": s}
              for s in (2, 3)]
    with LlamaServer(cfg, binary=b11434.with_cpu("haswell").server) as plain, \
            LlamaServer(cfg, binary=patched.with_cpu("haswell").server) as truth:
        args = ["-m", smollm2, "-md", smollm2_draft, "--spec-type", "draft-simple", "-np", 1]
        with running_proxy(plain.url, args, tmp_path / "log") as url:
            got = [native(url, b) for b in bodies]
        want = [native(truth.url, b)[1] for b in bodies]
    for (headers, g), w in zip(got, want):
        assert int(headers["x-spec-replay-filled"]) > 0
        assert_same(native_values(g), native_values(w))
