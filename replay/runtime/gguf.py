"""Is a file a complete GGUF? Checked before libllama is asked to load it.

libllama memory-maps the tensor data and, on a truncated file, can fault (SIGBUS) or abort
with its message only in its log. This walks the GGUF header (gguf-py's layout: magic,
version, tensor count, metadata key/values, tensor infos; docs/gguf.md in llama.cpp)
without materialising any value, computes where the last tensor's data ends (block sizes
from `gguf.GGML_QUANT_SIZES`, data aligned to `general.alignment`, default 32) and compares
that with the file size. Gemma 3's 262k-token vocabulary is skipped in ~0.03 s. The walk is made once per
file version and process, and keeps what other questions about the file need: its tensor names and a
digest of its vocabulary's token texts (`vocab_digest`).
"""
from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from replay.errors import ModelError

MAGIC = b"GGUF"
TOKENS_KEY = b"tokenizer.ggml.tokens"  # every token's text, by id (gguf-py Keys.Tokenizer.LIST)
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # type -> bytes
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_U64 = struct.Struct("<Q")


class _Corrupt(Exception):
    pass


class _Reader:
    def __init__(self, buf):
        self.buf, self.off, self.size = buf, 0, len(buf)

    def take(self, n: int) -> int:
        if n < 0 or self.off + n > self.size:
            raise _Corrupt("the header runs past the end of the file")
        at = self.off
        self.off += n
        return at

    def u32(self) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8))[0]

    def string(self) -> bytes:
        n = self.u64()
        at = self.take(n)
        return bytes(self.buf[at:at + n])

    def _skip_strings(self, count: int) -> None:
        """`count` length-prefixed strings (a vocabulary: 262,144 of them in Gemma 3), in one tight loop."""
        buf, off, size, u64 = self.buf, self.off, self.size, _U64.unpack_from
        for _ in range(count):
            if off + 8 > size:
                raise _Corrupt("the header runs past the end of the file")
            off += 8 + u64(buf, off)[0]
        if off > size:
            raise _Corrupt("the header runs past the end of the file")
        self.off = off

    def skip_value(self, vtype: int) -> None:
        if vtype in _SCALAR:
            self.take(_SCALAR[vtype])
        elif vtype == _STRING:
            self.take(self.u64())
        elif vtype == _ARRAY:
            etype, count = self.u32(), self.u64()
            if etype in _SCALAR:
                self.take(_SCALAR[etype] * count)
            elif etype == _STRING:
                self._skip_strings(count)
            elif etype == _ARRAY:
                for _ in range(count):
                    self.skip_value(_ARRAY)
            else:
                raise _Corrupt(f"unknown array element type {etype}")
        else:
            raise _Corrupt(f"unknown metadata value type {vtype}")


def _header(buf) -> tuple[_Reader, int, int, tuple[int, int] | None, frozenset[str]]:
    """(a reader at the first tensor info, the tensor count, the data alignment, where the token texts'
    array value lies in `buf`: (start, end), or None, the metadata keys) of GGUF bytes `buf`."""
    r = _Reader(buf)
    if bytes(buf[r.take(4):4]) != MAGIC:
        raise _Corrupt("not a GGUF file")
    version = r.u32()
    if version not in (2, 3):
        raise _Corrupt(f"unsupported GGUF version {version}")
    n_tensors, n_kv = r.u64(), r.u64()
    if n_tensors == 0 or n_tensors > 1_000_000 or n_kv > 1_000_000:
        raise _Corrupt(f"implausible header ({n_tensors} tensors, {n_kv} metadata keys)")
    alignment, tokens = 32, None
    keys = []
    for _ in range(n_kv):
        key = r.string()
        keys.append(key.decode("utf-8", "replace"))
        vtype = r.u32()
        if key == b"general.alignment" and vtype == _UINT32:
            alignment = r.u32()
            if alignment == 0 or alignment & (alignment - 1):
                raise _Corrupt(f"general.alignment {alignment} is not a power of two")
        else:
            start = r.off
            r.skip_value(vtype)
            if key == TOKENS_KEY and vtype == _ARRAY:
                tokens = (start, r.off)
    return r, n_tensors, alignment, tokens, frozenset(keys)


def _tensor_infos(r: _Reader, n_tensors: int):
    """(name, elements, type, offset) of each tensor info, in file order."""
    for _ in range(n_tensors):
        name = r.string()
        n_dims = r.u32()
        if n_dims > 8:
            raise _Corrupt(f"tensor {name[:64]!r} has {n_dims} dimensions")
        n = 1
        for _ in range(n_dims):
            n *= r.u64()
        ttype, offset = r.u32(), r.u64()
        yield name, n, ttype, offset


@dataclass(frozen=True)
class Summary:
    """What one walk of a GGUF header tells: where its last tensor's data ends, its tensor names, a
    digest of its token texts' array (type, count and every text; None without one), its metadata keys."""

    data_end: int
    names: frozenset[str]
    vocab: bytes | None
    keys: frozenset[str] = frozenset()


def summary_of(buf) -> Summary:
    """The Summary of GGUF bytes `buf` (raises _Corrupt)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    r, n_tensors, alignment, tokens, keys = _header(buf)
    end, names = 0, []
    for name, n, ttype, offset in _tensor_infos(r, n_tensors):
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        except (ValueError, KeyError):
            raise _Corrupt(f"tensor {name[:64]!r} has unknown type {ttype}") from None
        end = max(end, offset + n // block * size)
        names.append(name.decode("utf-8", "replace"))
    start = (r.off + alignment - 1) // alignment * alignment
    vocab = hashlib.blake2b(buf[tokens[0]:tokens[1]], digest_size=32).digest() if tokens else None
    return Summary(start + end, frozenset(names), vocab, keys)


def tensor_names(path: Path | str) -> frozenset[str]:
    """The names of a GGUF file's tensors (checked: check_gguf), read from its header alone."""
    return _summary(path).names


def vocab_digest(path: Path | str) -> bytes | None:
    """A digest of a GGUF file's token texts (tokenizer.ggml.tokens: their count and every text, by id), or
    None where it has none: two files with the same digest hold the same text for every token id."""
    return _summary(path).vocab


# metadata keys of layers whose memory keeps more than a position's K and V (llama-arch.cpp LLM_KV_*):
# a sliding window, a recurrent state (Mamba's ssm, RWKV's wkv, LFM2's short convolution)
_WINDOW_OR_STATE = (".attention.sliding_window", ".ssm.", ".wkv.", ".shortconv.")


def windowed_or_recurrent(path: Path | str) -> bool:
    """Does the model have sliding-window attention or recurrent layers, by its metadata keys? Such a
    memory cannot drop a suffix, so a speculating server checkpoints it and a replay of its values runs
    the server's loop (commands/looped.py). A hint, read from the header alone, for starting to load a
    draft model early: the loop itself asks the context.

    >>> from replay.paths import FIXTURES
    >>> windowed_or_recurrent(FIXTURES / "tiny-gemma3-target.gguf"), windowed_or_recurrent(FIXTURES / "tiny-target.gguf")
    (True, False)
    """
    return any(part in k for k in _summary(path).keys for part in _WINDOW_OR_STATE)


_SUMMARIES: dict[tuple[str, int, int], Summary] = {}  # (path, size, mtime) found complete in this process


def _summary(path: Path | str) -> Summary:
    p = check_gguf(path)
    st = p.stat()
    return _SUMMARIES[(str(p.resolve()), st.st_size, st.st_mtime_ns)]


def check_gguf(path: Path | str) -> Path:
    """Fail with one clear line unless `path` is a complete GGUF file (once per file version and process)."""
    p = Path(path)
    if not p.is_file():
        raise ModelError(f"model file not found: {p}")
    st = p.stat()
    size, key = st.st_size, (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if key in _SUMMARIES:
        return p
    if size < 24:
        raise ModelError(f"{p} is not a GGUF file ({size} bytes)")
    try:
        with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if mm[:4] != MAGIC:
                raise ModelError(f"{p} is not a GGUF file (magic {bytes(mm[:4])!r})")
            summary = summary_of(mm)
    except _Corrupt as e:
        raise ModelError(f"{p} is truncated or corrupt: {e}") from e
    except OSError as e:
        raise ModelError(f"cannot read {p}: {e.strerror or e}") from e
    if summary.data_end > size:
        raise ModelError(f"{p} is truncated: its tensors need {summary.data_end} bytes, the file has {size}")
    _SUMMARIES[key] = summary
    return p
