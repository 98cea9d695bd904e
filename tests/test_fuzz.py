"""Property-based fuzzing of every transcript reader and of token alignment (hypothesis).

Seeds are the committed transcripts of a speculating b11434 server on the tiny fixtures
(fixtures/transcripts/), in every input shape `recover` reads. Each unmutated seed must recover
cleanly; each case then mutates one (replacing values with wrong types, huge numbers, NaN/inf,
random text; deleting keys; duplicating list items and SSE events; truncating the text;
injecting invalid UTF-8; giving ids outside the vocabulary) and runs the whole pipeline on the
bytes: decode, read, align tokens, evaluate the tiny target, compare, repair, re-read the repaired
file. Every case must end in a clean one-line SpecReplayError or a correct result (the repaired
file reads back with the same number of records), within 10 s; any other exception is a crash
and fails the test. No server is needed.
"""
from __future__ import annotations

import copy
import json
import os
import signal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.commands.recover import Recoverer
from replay.errors import SpecReplayError
from replay.llamacpp.models import tiny_target
from replay.paths import FIXTURES
from replay.report.repair import serialise
from replay.transcripts.readers import decode_text, read_text

CASES = int(os.environ.get("SPEC_REPLAY_FUZZ_CASES", "300"))  # per reader shape (the same cases every run); more for a deep run
FUZZ = settings(max_examples=CASES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


def _transcript(name: str) -> dict:
    return json.loads((FIXTURES / "transcripts" / name).read_text())


def _events(t: dict) -> list:
    return [json.loads(e) if e != "[DONE]" else e for e in t["events"]]


@pytest.fixture(scope="module")
def seeds():
    """One real document per reader shape, as bytes + the --request body it needs (or None)."""
    native = _transcript("tiny-draft-simple.json")
    stream = _transcript("tiny-completion-stream-post.json")
    cmpl = _transcript("tiny-v1-completions.json")
    cstream = _transcript("tiny-v1-completions-stream.json")
    chat = _transcript("tiny-v1-chat-stream.json")
    creq, sreq = cmpl["request"], cstream["request"]
    sse_text = "".join(f"data: {e}\n\n" for e in cstream["events"])
    return {
        "transcript": (json.dumps(native, indent=2).encode(), None),
        "transcript-stream": (json.dumps(stream, indent=2).encode(), None),
        "transcript-chat-stream": (json.dumps(chat).encode(), None),
        "pair-body": (json.dumps({"request": creq, "response": cmpl["response"]}).encode(), None),
        "pair-chunks": (json.dumps({"request": sreq, "response": _events(cstream)}).encode(), None),
        "pair-sse-text": (json.dumps({"request": sreq, "response": sse_text}).encode(), None),
        "sse-file": (sse_text.encode(), sreq),
        "openai-dump": (json.dumps(cmpl["response"], indent=2).encode(), creq),
        "jsonl": ((json.dumps(native) + "\n" + json.dumps({"request": creq, "response": cmpl["response"]})
                   + "\n").encode(), None),
    }


@pytest.fixture(scope="module")
def recoverer():
    r = Recoverer(tiny_target(), flags={"threads": 1})
    yield r
    r.close()


HOSTILE = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.sampled_from([-1, 0, 8, 7, 10**9, 2**31, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.lists(st.integers(-3, 300), max_size=4), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _slots(obj, out, depth=0):
    """Every (container, key) in a JSON value."""
    if depth > 12:
        return out
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in list(items):
        out.append((obj, k))
        _slots(v, out, depth + 1)
    return out


@st.composite
def mutated(draw, seed: bytes):
    text = seed.decode()
    is_json = text.lstrip().startswith(("{", "["))
    docs = None
    if is_json:
        try:
            docs = [json.loads(text)]
        except ValueError:
            docs = [json.loads(line) for line in text.splitlines() if line.strip()]
    if docs is not None:
        for _ in range(draw(st.integers(0, 3))):
            doc = docs[draw(st.integers(0, len(docs) - 1))]
            slots = _slots(doc, [])
            if not slots:
                break
            cont, key = draw(st.sampled_from(slots))
            op = draw(st.sampled_from(["replace", "replace", "delete", "dup", "string-events"]))
            if op == "replace":
                cont[key] = draw(HOSTILE)
            elif op == "delete":
                del cont[key]
            elif op == "dup" and isinstance(cont, list):
                cont.insert(key, copy.deepcopy(cont[key]))  # duplicated item / SSE event
            elif op == "string-events" and isinstance(cont[key], dict):
                cont[key] = json.dumps(cont[key])
        text = "\n".join(json.dumps(d, allow_nan=True) for d in docs) + "\n"
    else:  # SSE text: duplicate or drop an event, or corrupt one
        events = text.split("\n\n")
        for _ in range(draw(st.integers(0, 2))):
            i = draw(st.integers(0, len(events) - 1))
            op = draw(st.sampled_from(["dup", "drop", "garble"]))
            if op == "dup":
                events.insert(i, events[i])
            elif op == "drop":
                events.pop(i)
            else:
                e = events[i]
                j = draw(st.integers(0, len(e)))
                events[i] = e[:j] + draw(st.text(max_size=6)) + e[j:]
            if not events:
                events = [""]
        text = "\n\n".join(events)
    data = text.encode("utf-8", "surrogatepass")
    if draw(st.integers(0, 9)) == 0:
        data = data[:draw(st.integers(0, len(data)))]
    if draw(st.integers(0, 9)) == 0:
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xe3\x81", b"\x00", b"\xed\xa0\x80"])) + data[at:]
    return data


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def run_pipeline(data: bytes, request: dict | None, recoverer: Recoverer) -> bool:
    """Decode, read, recover and repair; re-read the repaired text. Raises only SpecReplayError;
    returns whether every record was recovered."""
    text = decode_text(data, "fuzz.json")
    records = read_text(text, "fuzz.json", request)
    done = [recoverer.recover(rec) for rec in records]
    if all(d.report.recovered for d in done):
        again = read_text(serialise(records, [d.container for d in done], text), "repaired.json", request)
        assert len(again) == len(records)
        return True
    return False


def _property(data: bytes, request, recoverer) -> None:
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(10)
    try:
        run_pipeline(data, request, recoverer)
    except SpecReplayError as e:
        assert str(e) and "\n" not in str(e).strip()  # one line
    except _Timeout:
        pytest.fail(f"no answer within 10 s for {data[:300]!r}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


READERS = ["transcript", "transcript-stream", "transcript-chat-stream", "pair-body", "pair-chunks", "pair-sse-text",
           "sse-file", "openai-dump", "jsonl"]


@pytest.mark.parametrize("reader", READERS)
def test_reader_survives_hostile_input(reader, seeds, recoverer):
    seed, request = seeds[reader]
    assert run_pipeline(seed, request, recoverer), "the unmutated seed must recover cleanly"

    @FUZZ
    @given(mutated(seed))
    def prop(data):
        _property(data, request, recoverer)

    prop()


@settings(max_examples=2000, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 24160))
def test_a_truncated_gguf_is_refused_before_libllama_loads_it(tmp_path_factory, n):
    from replay.errors import ModelError
    from replay.runtime.gguf import check_gguf
    data = tiny_target().read_bytes()
    p = tmp_path_factory.getbasetemp() / "cut.gguf"
    p.write_bytes(data[:n])
    if n == len(data):
        assert check_gguf(p) == p
    else:
        with pytest.raises(ModelError, match="truncated|not a GGUF"):
            check_gguf(p)
