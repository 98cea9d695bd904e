"""When every token matches and only the draft totals differ, trace says why only where something
explains it: b11434 drafts every busy slot in one batch of the draft model (common/speculative.cpp:383-386,
446-453), so a record whose batches may have been shared with another request's (a several-slot server, or
a record it ran beside) is explained by numerics; a one-slot record with nothing beside it is not.

Real runs of the tiny models on the transcript recorded from a b11434 server; the draft totals are then
changed, as a 4-slot server under concurrent requests changed them (measured in CI: drafted 27 and accepted
21 where the replay drafted otherwise, every token the same)."""
from __future__ import annotations

import copy
import json

from cli_helpers import run

from replay.paths import FIXTURES

MODEL, DRAFT = str(FIXTURES / "tiny-target.gguf"), str(FIXTURES / "tiny-draft.gguf")


def _record(*, draft_n: int | None = None, slots: int | None = None, created: int | None = None) -> dict:
    rec = copy.deepcopy(json.loads((FIXTURES / "transcripts" / "tiny-draft-simple.json").read_text()))
    if draft_n is not None:
        rec["response"]["timings"]["draft_n"] = draft_n
    if slots is not None:
        rec["server"]["props"]["total_slots"] = slots
    if created is not None:  # a response made in that second, whose request took 1.5 s
        rec["response"]["created"] = created
        rec["response"]["timings"].update(prompt_ms=500.0, predicted_ms=1000.0)
    return rec


def _trace(tmp_path, *records: dict, extra: tuple[str, ...] = ()) -> tuple[int, list[dict], str]:
    src = tmp_path / "t.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    r = run("trace", src, "-m", MODEL, "-md", DRAFT, "--json", *extra)
    d = json.loads(r.stdout)
    text = run("trace", src, "-m", MODEL, "-md", DRAFT, *extra).output
    return r.exit_code, d["records"] if "records" in d else [d], text


def test_the_recorded_draft_totals_are_reproduced(tmp_path):
    code, [tr], _ = _trace(tmp_path, _record())
    assert code == 0 and tr["reproduced"] is True
    assert (tr["draft_n"], tr["draft_n_accepted"]) == (tr["server_draft_n"], tr["server_draft_n_accepted"]) == (36, 7)


def test_other_draft_totals_on_a_one_slot_server_are_not_explained(tmp_path):
    code, [tr], _ = _trace(tmp_path, _record(draft_n=35))
    assert code == 1 and tr["reproduced"] is False and tr["first_divergence"] is None
    assert tr["divergence"] is None
    assert any("the draft totals differ (trace drafted 36, accepted 7; the server 35, 7)" in n for n in tr["notes"])


def test_other_draft_totals_on_a_four_slot_server_name_the_slots_as_a_possibility_not_a_cause(tmp_path):
    """A slot count is no evidence that a record's batches were shared (a lone request on a fresh 4-slot
    server runs alone): the totals are not explained away, and the note names the possibility."""
    code, [tr], text = _trace(tmp_path, _record(draft_n=35, slots=4))
    assert code == 1 and tr["reproduced"] is False and tr["first_divergence"] is None
    assert tr["divergence"] is None
    assert any(n.endswith("or a 4-slot server (/props total_slots) drafted other requests' tokens in the same batch, "
                          "if any ran at the same time (nothing in the transcript shows one did)") for n in tr["notes"])


def test_records_that_ran_side_by_side_explain_each_other(tmp_path):
    a, b = _record(draft_n=35, created=1_800_000_000), _record(created=1_800_000_000)
    code, [ta, tb], _ = _trace(tmp_path, a, b)
    assert code == 1 and ta["reproduced"] is False and tb["reproduced"] is True
    assert ta["divergence"]["cause"] == "numerics"
    assert "it ran at the same time as record 2 (their created and timings overlap)" in ta["divergence"]["text"]
    # the same two records a minute apart: nothing explains the first one's totals
    code, [ta, _], _ = _trace(tmp_path, a, _record(created=1_800_000_060))
    assert ta["divergence"] is None


def test_the_user_can_say_the_requests_ran_at_once(tmp_path):
    """/completion responses carry no `created`: a harness's concurrent requests leave nothing in the file
    that shows it. --shared-batches is the user saying so; the totals are then explained by the draft
    model's shared batches, and the text names the option as the evidence."""
    code, [tr], text = _trace(tmp_path, _record(draft_n=35, slots=4), extra=("--shared-batches",))
    assert code == 1 and tr["reproduced"] is False and tr["first_divergence"] is None
    assert tr["divergence"]["cause"] == "numerics"
    assert "the draft totals differ (trace drafted 36, accepted 7; the server 35, 7)" in tr["divergence"]["text"]
    assert "may have been shared (--shared-batches)" in tr["divergence"]["text"]
    # what the option explains is only the totals: a record whose tokens part is still judged on its figures
    bad = _record(slots=4)
    bad["request"]["seed"] += 1
    code, [tr], _ = _trace(tmp_path, bad, extra=("--shared-batches",))
    assert code == 1 and tr["first_divergence"] is not None
