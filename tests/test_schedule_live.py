"""recover on the server's own schedule, past 256 positions: the values of the patched server, bit for bit.

The truth here is not an unspeculated server: it is the same b11434 build patched by
`spec-replay patch` (it reports the values its speculative loop computed), sent the same request with
the same flags. Its tokens are the unpatched server's. Each prompt is 1,000 tokens or more, so every
token after the first is computed over 512 KV cells or more, where a one-token decode splits the KV
sum by thread (ggml-cpu ops.cpp:9489-9492) and a verify batch does not: a replay that decoded every
token alone with its own threads (the schedule before schedule/rows.py) is 0.1-0.45 nats off on most
placeholders (measured on the first case: 63 of 64 values over 5e-4, max 0.452).
"""
from __future__ import annotations

import json

import pytest
from cli_helpers import one_error, run
from tiers import WIDE, default_and_wide

from replay.commands.record import RequestItem, record_one
from replay.llamacpp.process import LlamaServer, ServerConfig
from replay.transcripts.entries import record_entries
from replay.transcripts.format import dumps
from replay.transcripts.readers import read_text

pytestmark = [pytest.mark.build, pytest.mark.live_server, pytest.mark.model]

STORY = ("The lighthouse keeper climbed the stairs every night at nine, lit the lamp, and wrote the weather "
         "in his book. ")
TEXT = STORY * 45 + "Retell the story in your own words."  # 1,170 prompt tokens in the chat template


def _item(endpoint: str, temp: float, text: str = TEXT) -> RequestItem:
    if endpoint == "chat":
        return RequestItem("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 48,
                                                    "logprobs": True, "top_logprobs": 2, "temperature": temp,
                                                    "seed": 3})
    body = {"prompt": text, "n_predict": 48, "n_probs": 2, "temperature": temp, "seed": 3, "ignore_eos": True}
    if endpoint == "post":
        body["post_sampling_probs"] = True
    return RequestItem("/completion", body)


def _pair(b11434, patched, cfg: ServerConfig, item: RequestItem) -> tuple[dict, dict]:
    """(the unpatched server's transcript, the patched server's) of one request, each on a fresh server."""
    out = []
    for binary in (b11434.server, patched.server):
        with LlamaServer(cfg, binary=binary) as srv:
            out.append(record_one(srv.url, item, srv.config.flags_block()))
    return out[0], out[1]


def _recover(t: dict, model, tmp_path, *args) -> tuple[dict, dict]:
    src, out = tmp_path / "t.json", tmp_path / "t.repaired.json"
    src.write_text(dumps(t))
    r = run("recover", src, "-m", model, "-o", out, "--force", "--json", *args)
    assert r.exit_code == 0, r.output[-3000:]
    return json.loads(r.stdout)["records"][0], json.loads(out.read_text())


def _max_diff(fixed: dict, truth: dict) -> tuple[float, int]:
    """(max |repaired - patched| over every value of every entry, entries compared)."""
    a = record_entries(read_text(json.dumps(fixed), "repaired")[0])
    b = record_entries(read_text(json.dumps(truth), "patched")[0])
    assert [e.id for e in a] == [e.id for e in b]
    worst = 0.0
    for x, y in zip(a, b):
        assert [u[0] for u in x.top] == [v[0] for v in y.top]
        worst = max([worst, abs(x.logprob - y.logprob)] + [abs(u[2] - v[2]) for u, v in zip(x.top, y.top)])
    return worst, len(a)


CASES = {  # id: (server flags beyond the model and the draft, endpoint, temperature)
    "draft-chat-t0-4-slots": ({"n_parallel": -1}, "chat", 0.0),
    "draft-chat-t1-4-slots": ({"n_parallel": -1}, "chat", 1.0),
    "draft-post-t1-4-slots": ({"n_parallel": -1}, "post", 1.0),
    "draft-completion-t1-threads-4": ({"n_parallel": -1, "threads": 4}, "completion", 1.0),
    "draft-chat-t0-threads-1": ({"threads": 1}, "chat", 0.0),
    "draft-chat-t1-2k-tokens-4-slots": ({"n_parallel": -1}, "chat", 1.0),
}
TEXTS = {"draft-chat-t1-2k-tokens-4-slots": STORY * 86 + "Retell the story in your own words."}  # 2,017 tokens


@pytest.mark.parametrize("case", default_and_wide(CASES, {"draft-chat-t0-threads-1", "draft-completion-t1-threads-4",
                                                          "draft-post-t1-4-slots", "draft-chat-t1-2k-tokens-4-slots"}))
def test_recovered_values_are_the_patched_servers_on_long_prompts(case, b11434, patched, smollm2, smollm2_draft,
                                                                   tmp_path):
    flags, endpoint, temp = CASES[case]
    cfg = ServerConfig(smollm2, n_ctx=4096, draft_model=smollm2_draft, spec_types=("draft-simple",), **flags)
    plain, truth = _pair(b11434, patched, cfg, _item(endpoint, temp, TEXTS.get(case, TEXT)))
    rep, fixed = _recover(plain, smollm2, tmp_path)
    c = rep["summary"]["counts"]
    assert rep["prompt_tokens"] >= (2000 if case in TEXTS else 1000) and c["placeholder"] + c["missing"] >= 20 and c["mismatch"] == 0, c
    assert rep["numerics"]["cause"] is None, rep["numerics"]  # a lone request: no lenient judgement
    rows = rep["schedule"]["rows"]
    assert rows["batched"] >= 20 and rep["schedule"]["threads"]["value"] == flags.get("threads", 2)
    worst, n = _max_diff(fixed, truth)
    print(f"\n{case}: {rep['prompt_tokens']} prompt tokens, rows {rows}; max |recovered - patched| {worst:.3g} "
          f"over {n} entries")
    assert worst == 0.0, worst


def _bare_pair(b11434, patched, smollm2, body: dict, temp: float = 0.0) -> tuple[dict, dict]:
    """(a bare SDK dump: the response with no flags block, the patched server's transcript) of an n-gram
    copy from a -t 4 server, whose real entries after the first came from one-token decodes past 256
    positions (values -t changes)."""
    cfg = ServerConfig(smollm2, n_ctx=4096, threads=4, spec_types=("ngram-mod",))
    copy = STORY * 40 + "Repeat the text above exactly:\n\n" + STORY * 3
    plain, truth = _pair(b11434, patched, cfg, RequestItem("/completion", {"prompt": copy, "n_predict": 64,
                                                                             "n_probs": 2, "temperature": temp,
                                                                             "seed": 9, **body}))
    rows_real = [e for e in record_entries(read_text(json.dumps(plain), "p")[0])[1:] if not e.is_placeholder]
    assert rows_real, "the n-gram drafter drafted every step: no one-token decode to tell -t by"
    bare = {k: v for k, v in plain.items() if k != "server"}
    bare["server"] = {k: v for k, v in plain["server"].items() if k != "flags"}
    return bare, truth


def test_an_unrecorded_thread_count_is_found_from_the_servers_values_then_exact(b11434, patched, smollm2, tmp_path):
    """recover assumes 2, finds its first one-token value past 256 positions off, decodes that row again
    on each candidate count (evaluation/threads.py), takes the count that reproduces it and recovers the
    record with it: the patched server's values, with no --threads given."""
    bare, truth = _bare_pair(b11434, patched, smollm2, {})
    rep, fixed = _recover(bare, smollm2, tmp_path)
    threads = rep["schedule"]["threads"]
    assert threads["source"] == "identified" and 4 in threads["candidates"], threads
    worst, n = _max_diff(fixed, truth)
    print(f"\nngram-mod -t 4, bare: rows {rep['schedule']['rows']}, threads {threads}; max |recovered - patched| "
          f"{worst:.3g} over {n}")
    assert worst == 0.0, worst


@WIDE
def test_an_unrecorded_thread_count_under_post_sampling_values_is_asked_for_then_exact(b11434, patched, smollm2,
                                                                                       tmp_path):
    """Post-sampling values need the sampler chain's state to tell counts apart, which the one-row search
    does not replay: recover says in one line to give --threads; given it, the values are the patched
    server's. (At temperature 0 a post-sampling value is 1 for the token drawn whatever the logits, so
    no count changes it and the record recovers as it is: this case samples at 1.)"""
    bare, truth = _bare_pair(b11434, patched, smollm2, {"post_sampling_probs": True}, temp=1.0)
    src = tmp_path / "bare.json"
    src.write_text(dumps(bare))
    line = one_error(run("recover", src, "-m", smollm2, "-o", tmp_path / "x.json", "--json"))
    assert "the server's -t?" in line and "give --threads N (2 assumed)" in line, line
    rep, fixed = _recover(bare, smollm2, tmp_path, "--threads", "4")
    worst, n = _max_diff(fixed, truth)
    print(f"\nngram-mod -t 4, post, bare: rows {rep['schedule']['rows']}; max |recovered - patched| {worst:.3g} "
          f"over {n}")
    assert worst == 0.0, worst


def test_a_three_turn_chat_on_the_servers_prompt_cache_is_the_patched_servers(b11434, patched, smollm2, smollm2_draft,
                                                                              tmp_path):
    """A chat of three turns on a default-flag speculating server with its prompt cache on: each turn's
    prompt is the conversation so far, and the server takes the previous turn's prompt and reply from its
    slot (timings.cache_n) and decodes only the rest. The reply's KV was written by verify batches and
    one-token decodes; recover computes each of those rows in its kind (schedule/rows.py), so it keeps
    what the previous record left, exactly cache_n positions, and every turn has the patched server's
    values (it used to blame "a request that is not the previous record" and stop)."""
    cfg = ServerConfig(smollm2, n_ctx=4096, draft_model=smollm2_draft, spec_types=("draft-simple",), n_parallel=-1)
    follow = ["Now tell it again in three sentences.", "Give the story a title and say why."]
    messages = [{"role": "user", "content": TEXT}]
    plain = []
    with LlamaServer(cfg, binary=b11434.server) as srv:
        for turn in range(3):
            body = {"messages": list(messages), "max_tokens": 40, "logprobs": True, "top_logprobs": 2,
                    "temperature": 0.0, "seed": 5, "cache_prompt": True}
            plain.append(record_one(srv.url, RequestItem("/v1/chat/completions", body), srv.config.flags_block()))
            if turn < 2:
                reply = plain[-1]["response"]["choices"][0]["message"]["content"]
                messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": follow[turn]}]
    with LlamaServer(cfg, binary=patched.server) as srv:
        truth = [record_one(srv.url, RequestItem("/v1/chat/completions", t["request"]), srv.config.flags_block())
                 for t in plain]
    cached = [t["response"]["timings"]["cache_n"] for t in plain]
    assert cached[0] == 0 and cached[1] > 1000 and cached[2] > cached[1], cached
    src, out = tmp_path / "chat.jsonl", tmp_path / "chat.repaired.jsonl"
    src.write_text("".join(dumps(t, indent=None) + "\n" for t in plain))
    r = run("recover", src, "-m", smollm2, "-o", out, "--force", "--json")
    assert r.exit_code == 0, r.output[-3000:]
    reports = json.loads(r.stdout)["records"]
    assert [rep["reused_prompt_tokens"] for rep in reports] == cached, [rep["prefix"] for rep in reports]
    assert [rep["prefix"] for rep in reports][1:] == ["server cache", "server cache"]
    for k, (line, want) in enumerate(zip(out.read_text().splitlines(), truth)):
        worst, n = _max_diff(json.loads(line), want)
        print(f"\nturn {k + 1}: {reports[k]['prompt_tokens']} prompt tokens ({cached[k]} cached), rows "
              f"{reports[k]['schedule']['rows']}; max |recovered - patched| {worst:.3g} over {n}")
        assert worst == 0.0, (k, worst)


GEMMA_CASES = {  # id: (server flags beyond the model and the draft, endpoint, temperature)
    "gemma3-chat-t0-4-slots": ({"n_parallel": -1}, "chat", 0.0),
    "gemma3-completion-t1-1-slot": ({"n_parallel": 1}, "completion", 1.0),
}


@pytest.mark.parametrize("case", default_and_wide(GEMMA_CASES, {"gemma3-chat-t0-4-slots"}))
def test_a_checkpointing_target_is_the_patched_servers_through_the_loop(case, b11434, patched, gemma3, gemma3_draft,
                                                                         tmp_path):
    """Gemma 3 cannot drop a suffix from its memory (sliding-window layers): a partly accepted draft is
    verified by restoring a checkpoint and decoding the accepted tokens again, in batches the transcript
    does not show. With the draft model (`-md`), recover replays the server's loop for those records
    (commands/looped.py): its tokens and draft totals are the server's, and its values the patched
    server's, bit for bit. Without anything that says how the server drafted (a bare response), recover
    keeps its one-token values, labelled approximate from the first token past 256 positions."""
    flags, endpoint, temp = GEMMA_CASES[case]
    cfg = ServerConfig(gemma3, n_ctx=4096, draft_model=gemma3_draft, spec_types=("draft-simple",), **flags)
    plain, truth = _pair(b11434, patched, cfg, _item(endpoint, temp))
    rep, fixed = _recover(plain, gemma3, tmp_path, "-md", gemma3_draft)
    c = rep["summary"]["counts"]
    assert rep["prompt_tokens"] >= 1000 and c["placeholder"] + c["missing"] >= 10 and c["mismatch"] == 0, c
    loop = rep["schedule"]["loop"]
    assert loop["replayed"] and loop["totals_checked"], loop
    assert "approximate_from" not in rep["schedule"], rep["schedule"]
    worst, n = _max_diff(fixed, truth)
    print(f"\n{case}: {rep['prompt_tokens']} prompt tokens, loop {loop}; max |recovered - patched| {worst:.3g} "
          f"over {n} entries")
    assert worst == 0.0, worst
    bare = json.loads(json.dumps({k: v for k, v in plain.items() if k != "server"}))  # its user gives -c and -np,
    (bare["response"].get("generation_settings") or {}).pop("speculative.types", None)  # not how it drafted
    rep, approx = _recover(bare, gemma3, tmp_path, "-md", gemma3_draft, "-c", "4096", "-np", str(flags["n_parallel"]))
    assert rep["schedule"]["approximate_from"] >= 1 and not rep["schedule"]["loop"]["replayed"], rep["schedule"]
    assert "how the server drafted" in rep["schedule"]["loop"]["why"]
    a = record_entries(read_text(json.dumps(approx), "approximate")[0])
    b = record_entries(read_text(json.dumps(truth), "patched")[0])
    off = max(abs(x.logprob - y.logprob) for x, y in zip(a, b))  # the tokens' own (their alternatives' order moves)
    print(f"{case}: the one-token schedule's values, labelled approximate: max |recovered - patched| {off:.3g} "
          "on the tokens' own logprobs")
    assert off > 1e-4, off  # what the loop replay removes (measured 0.006 and 0.353)


OTHER = ("A baker in a small town rose before dawn to knead bread, and sold loaves to farmers at the market. ")
COPIES = [STORY * 45, OTHER * 42, STORY * 30]  # three unrelated prompts of 760-1,120 tokens, then a copy


def _copy_session(binary, cfg: ServerConfig) -> list[dict]:
    """Three /completion requests one after another on one fresh server, as an eval harness sends them."""
    with LlamaServer(cfg, binary=binary) as srv:
        return [record_one(srv.url, RequestItem("/completion", {
            "prompt": text + "\nRepeat the text above exactly:\n\n" + text[:300], "n_predict": 64, "n_probs": 2,
            "temperature": 0.0, "seed": 9}), srv.config.flags_block()) for text in COPIES]


def _recover_file(records: list[dict], model, tmp_path, *args):
    src = tmp_path / "session.jsonl"
    src.write_text("".join(dumps(t, indent=None) + "\n" for t in records))
    return src, run("recover", src, "-m", model, "-o", tmp_path / "session.repaired.jsonl", "--force", "--json", *args)


def test_requests_in_turn_on_a_default_4_slot_server_are_the_patched_servers(b11434, patched, smollm2, tmp_path):
    """Sequential unrelated requests on a default-flag server (4 slots, one unified KV cache) go to
    different slots (the least recently used), yet none of them decodes over another slot's cells: when a
    task starts, the server saves its idle slots to the prompt cache and clears them
    (server-context.cpp:2641-2655, --cache-idle-slots, on by default). So every record, recovered on a
    context of its own, has the patched server's values, one-token decodes past 256 positions included."""
    cfg = ServerConfig(smollm2, n_ctx=8192, spec_types=("ngram-mod",), n_parallel=-1)
    plain, truth = _copy_session(b11434.server, cfg), _copy_session(patched.server, cfg)
    slots = [t["response"]["id_slot"] for t in plain]
    assert len(set(slots[:2])) == 2, slots  # the second request ran on another slot than the first
    src, r = _recover_file(plain, smollm2, tmp_path)
    assert r.exit_code == 0, r.output[-3000:]
    reports = json.loads(r.stdout)["records"]
    assert all(rep["numerics"]["cause"] is None for rep in reports), [rep["numerics"] for rep in reports]
    for k, (line, want) in enumerate(zip((tmp_path / "session.repaired.jsonl").read_text().splitlines(), truth)):
        worst, n = _max_diff(json.loads(line), want)
        print(f"\nrequest {k + 1} (slot {slots[k]}): rows {reports[k]['schedule']['rows']}; max |recovered - patched| "
              f"{worst:.3g} over {n}")
        assert worst == 0.0, (k, worst)
    assert reports[1]["schedule"]["rows"]["alone_split"] >= 10  # the second request's one-token decodes past 256


def test_a_4_slot_server_that_keeps_idle_slots_is_named_as_the_cause(b11434, smollm2, tmp_path):
    """With --cache-ram 0 (no prompt cache, so idle slots are not cleared: server-context.cpp:1553-1557)
    the first request's cells stay in the unified cache and every later decode's attention views them,
    masked, in its chunks: the second request's real values then differ from a replay on a context of its
    own (measured 0.013 nats on its first entry). The recorded flags say why, so recover judges them as it
    judges shared batches, names that cause and says which values are kept; from a bare dump, the one
    line names --cache-ram 0 among the causes."""
    cfg = ServerConfig(smollm2, n_ctx=8192, spec_types=("ngram-mod",), n_parallel=-1, cache_ram_mib=0)
    plain = _copy_session(b11434.server, cfg)
    assert plain[0]["server"]["flags"]["--cache-ram"] == 0
    src, r = _recover_file(plain, smollm2, tmp_path)
    assert r.exit_code == 0, r.output[-3000:]
    second = json.loads(r.stdout)["records"][1]["numerics"]
    assert second["cause"] == "KV layout" and second["judged_by"] == "evidence", second
    assert "other slots' cells" in second["why"] and "--cache-ram 0" in second["why"], second
    assert second["weighted_diff_first_entry"] > 1e-4, second  # the cells change values: not judged for nothing
    bare = [{**t, "server": {k: v for k, v in t["server"].items() if k != "flags"}} for t in plain]
    src, r = _recover_file(bare, smollm2, tmp_path)
    line = one_error(r)
    assert "#2 token 0" in line and "--cache-ram 0" in line, line


DAYS = " ".join(f"On day {k} the keeper saw {k % 7 + 2} ships and {k % 5 + 1} gulls." for k in range(1, 60))
TILED = {  # id: (server flags beyond the model, request body)
    "ngram-mod-defaults-4-slots": ({"spec_types": ("ngram-mod",), "n_parallel": -1},
                                   {"prompt": DAYS + "\nRepeat the text above exactly:\n\n" + DAYS[:100],
                                    "n_predict": 256, "n_probs": 2, "temperature": 0.0, "seed": 9}),
    "draft-n-max-64": ({"spec_types": ("draft-simple",), "draft_n_max": 64},
                       {"prompt": TEXT, "n_predict": 96, "n_probs": 2, "temperature": 1.0, "seed": 3,
                        "ignore_eos": True}),
}


@pytest.mark.parametrize("case", default_and_wide(TILED, {"ngram-mod-defaults-4-slots"}))
def test_verify_batches_of_64_rows_are_the_patched_servers_through_the_loop(case, b11434, patched, smollm2,
                                                                          smollm2_draft, tmp_path):
    """ngram-mod drafts 48 to 64 tokens by default (--spec-ngram-mod-n-min/-n-max), so a verify batch can
    have 65 rows; from 64 rows on, ggml-cpu computes its attention tile by tile (ops.cpp:9545-9566), which
    no one-row decode gives, and which rows it had (rejected drafts included) the transcript does not show.
    recover replays the server's loop for such a server (commands/recover.py approximate_from, `tiled`):
    the patched server's values, bit for bit; the one-token schedule disagreed with the server's own real
    values after the first such batch (183 of 256 tokens, measured on the first case). A bare /completion
    dump says how the server drafted too: its generation_settings echo the speculative types."""
    flags, body = TILED[case]
    draft = smollm2_draft if "draft-simple" in flags["spec_types"] else None
    cfg = ServerConfig(smollm2, n_ctx=4096, draft_model=draft, **flags)
    plain, truth = _pair(b11434, patched, cfg, RequestItem("/completion", body))
    assert max(truth["response"]["timings"]["draft_n"], 0) >= 63, truth["response"]["timings"]
    rep, fixed = _recover(plain, smollm2, tmp_path)
    loop = rep["schedule"]["loop"]
    assert loop["replayed"] and loop["totals_checked"], loop
    worst, n = _max_diff(fixed, truth)
    print(f"\n{case}: {rep['prompt_tokens']} prompt tokens, rows {rep['schedule']['rows']}, loop {loop}; "
          f"max |recovered - patched| {worst:.3g} over {n}")
    assert worst == 0.0, worst
    if draft is None:
        bare = {**plain, "server": {k: v for k, v in plain["server"].items() if k != "flags"}}
        rep, fixed = _recover(bare, smollm2, tmp_path)
        assert rep["schedule"]["loop"]["replayed"] and _max_diff(fixed, truth)[0] == 0.0, rep["schedule"]
