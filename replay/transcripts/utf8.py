"""The server's rule for the text it sends of a token: whole UTF-8 characters only. Pure.

validate_utf8 (tools/server/server-common.cpp:944-969) counts the leading bytes that end in a whole
character: it looks at the last four bytes for a lead byte whose sequence is cut off, and counts
everything when there is none (invalid bytes included). The server stops on a stop string only while
its text is whole by that rule (server-context.cpp:1977-1996), and a probability entry's "token" is the
piece cut to that length (server-task.cpp:267-268, 285-286), written by nlohmann's dump with invalid
bytes replaced by U+FFFD (common/json.cpp:344, safe_json_to_str at server-common.cpp:1643).
"""
from __future__ import annotations


def utf8_complete(text: bytes) -> int:
    """How many leading bytes of `text` the server counts as whole characters (validate_utf8).

    >>> utf8_complete("café".encode()), utf8_complete("café".encode()[:-1]), utf8_complete("🌊".encode()[:3])
    (5, 3, 0)
    >>> utf8_complete(bytes([97, 255]))   # an invalid byte is not a cut-off character
    2
    """
    n = len(text)
    for i in range(1, min(4, n) + 1):
        c = text[n - i]
        if (c & 0xE0) == 0xC0 and i < 2 or (c & 0xF0) == 0xE0 and i < 3 or (c & 0xF8) == 0xF0 and i < 4:
            return n - i
    return n


def sent_text(piece: bytes) -> str:
    """The "token" string the server sends for a piece: its whole characters (utf8_complete), invalid
    bytes among them each replaced by U+FFFD as nlohmann's dump does; "bytes" keeps the piece whole.

    >>> sent_text("café".encode()), sent_text("café".encode()[:-1]), sent_text(b"a\\xff")
    ('café', 'caf', 'a\\ufffd')
    """
    return piece[:utf8_complete(piece)].decode("utf-8", "replace")
