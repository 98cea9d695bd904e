"""The server looks for stop strings only while its text ends in a whole UTF-8 character
(tools/server/server-context.cpp:1977-1996, validate_utf8 at tools/server/server-common.cpp:944-969):
transcripts/utf8.py utf8_complete mirrors that rule, checked here against the server's own function,
taken from the pinned b11434 source and compiled with g++, on hostile byte strings (every cut of
1-, 2-, 3- and 4-byte characters, stray continuation and invalid bytes).

The same rule cuts the "token" text of every probability entry (server-task.cpp:267-268, 285-286),
which nlohmann's dump then writes with invalid bytes replaced (common/json.cpp:344): a repaired entry's
text is transcripts/utf8.py sent_text, checked against that code compiled with the pinned nlohmann."""
from __future__ import annotations

import itertools
import json
import re
import subprocess

import pytest

from replay.llamacpp.build import unpack_source
from replay.transcripts.utf8 import sent_text, utf8_complete

pytestmark = [pytest.mark.build]

DRIVER = r"""
#include <cstdio>
#include <string>
#include <iostream>
%s
int main() {
    std::string line;
    while (std::getline(std::cin, line)) {  // hex bytes per line
        std::string s;
        for (size_t i = 0; i + 1 < line.size(); i += 2) s.push_back((char) std::stoi(line.substr(i, 2), nullptr, 16));
        std::printf("%%zu\n", validate_utf8(s));
    }
}
"""


def _servers_function() -> str:
    text = (unpack_source("b11434") / "tools" / "server" / "server-common.cpp").read_text()
    m = re.search(r"^size_t validate_utf8\(const std::string& text\) \{.*?^\}", text, re.S | re.M)
    assert m, "validate_utf8 is not where server-common.cpp kept it"
    return m.group(0)


def _hostile() -> list[bytes]:
    chars = ["a", "é", "€", "🌊"]
    out = [b""]
    for a, b in itertools.product(chars, repeat=2):
        whole = (a + b).encode()
        out += [whole[:k] for k in range(len(whole) + 1)]
    out += [bytes([x]) for x in (0x80, 0xbf, 0xc0, 0xc3, 0xe2, 0xf0, 0xf8, 0xff)]
    out += [b"a" + bytes([x, y]) for x, y in itertools.product((0x80, 0xc3, 0xe2, 0xf0, 0xff), repeat=2)]
    return list(dict.fromkeys(out))


def test_the_whole_character_rule_is_the_servers(compile_cpp):
    exe = compile_cpp("validate_utf8", DRIVER % _servers_function())
    cases = _hostile()
    p = subprocess.run([str(exe)], input="".join(c.hex() + "\n" for c in cases), capture_output=True, text=True,
                       check=True, timeout=60)
    theirs = [int(x) for x in p.stdout.split()]
    assert len(theirs) == len(cases)
    assert [utf8_complete(c) for c in cases] == theirs
    assert any(t < len(c) for t, c in zip(theirs, cases))  # the cases do cut characters


ENTRY_DRIVER = r"""
#include <cstdio>
#include <string>
#include <iostream>
#include <nlohmann/json.hpp>
using json = nlohmann::ordered_json;
%s
int main() {
    std::string line;
    while (std::getline(std::cin, line)) {  // hex bytes per line: a token's piece
        std::string txt;
        for (size_t i = 0; i + 1 < line.size(); i += 2) txt.push_back((char) std::stoi(line.substr(i, 2), nullptr, 16));
        txt.resize(validate_utf8(txt));  // server-task.cpp:268
        std::cout << json {{"token", txt}}.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
    }
}
"""


def test_an_entrys_token_text_is_the_servers(compile_cpp):
    vendor = unpack_source("b11434") / "vendor"
    exe = compile_cpp("entry_text", ENTRY_DRIVER % _servers_function(), include=(vendor,))
    cases = _hostile() + [b"a\xff", b"\xed\xa0\x80", b"\xc0\x80z", b"\xf4\x90\x80\x80", b"\xe2\x82a\xe2\x82\xac"]
    p = subprocess.run([str(exe)], input="".join(c.hex() + "\n" for c in cases), capture_output=True, text=True,
                       check=True, timeout=60)
    theirs = [json.loads(line)["token"] for line in p.stdout.splitlines()]
    assert len(theirs) == len(cases)
    assert [sent_text(c) for c in cases] == theirs
    assert theirs[cases.index(b"a\xff")] == "a\ufffd"  # the repair wrote "a" here before
