"""Which libllama the replay evaluates with (runtime/binding.py, llamacpp/libllama.py).

A server computes with its own build's ggml kernels; the replay is bit-exact with it on that build's
libllama, which llama-cpp-python's binding can call when the build's llama.h declares what the
replay uses the binding's way. Measured on the builds of the index: b10679 and later can, b10666
and older cannot (another llama_model_params); there b10705's draft-simple greedy totals, which the
bundled libllama missed at a near-tie, come out as the server's (scripts/build_matrix.py).

The quick tier checks the header reading and the ABI rule; the `build` tests run the command line in
a subprocess (a process holds one libllama) against the b11434 tree.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from replay.llamacpp.models import tiny_draft, tiny_target
from replay.paths import FIXTURES, REPO_ROOT
from replay.runtime import binding

TRANSCRIPT = FIXTURES / "transcripts" / "tiny-draft-simple.json"  # recorded on b11434


def header_like_the_binding(rename: tuple[str, str, str] | None = None, params: dict[str, int] | None = None) -> str:
    """A llama.h declaring exactly the binding's structs and functions, with one field renamed or
    one function given another parameter count."""
    structs, funcs = binding.binding_layout()
    out = []
    for name, fields in structs.items():
        decls = []
        for f in fields:
            if rename and rename[0] == name and rename[1] == f:
                f = rename[2]
            decls.append(f"        int32_t {f}; // a comment; with a semicolon")
        out.append(f"    typedef struct {name} {{\n" + "\n".join(decls) + f"\n    }} {name};\n")
    for name in binding.FUNCTIONS:
        n = (params or {}).get(name, funcs[name])
        args = ",\n            ".join(f"int32_t a{i}" for i in range(n)) or "void"
        out.append(f"    LLAMA_API int32_t {name}(\n            {args});\n")
    return "\n".join(out)


def test_every_libllama_function_the_replay_calls_is_in_the_checked_list():
    called = set()
    for p in (REPO_ROOT / "replay").rglob("*.py"):
        called |= set(re.findall(r"\bL\.(llama_\w+)\(", p.read_text()))
    called -= {"llama_log_callback", "llama_token_data_array", "llama_token_data", "llama_logit_bias",
               "llama_batch", "llama_embd"}  # ctypes types and callback factories: struct checks cover them
    # (llama_embd, MTP's {data, n_rows, n_embd}, is b11434's llama.h:1013-1017 as the binding declares it)
    known = set(binding.FUNCTIONS) | set(binding.MTP_FUNCTIONS)
    assert called <= known, called - known


def test_a_header_declaring_what_the_binding_declares_is_callable():
    assert binding.abi_differences(header_like_the_binding()) == []


def test_a_struct_with_another_field_is_named():
    diffs = binding.abi_differences(header_like_the_binding(rename=("llama_context_params", "n_ctx", "n_ctx_text")))
    assert diffs == ["struct llama_context_params differs (has n_ctx_text; lacks n_ctx)"]


def test_a_function_with_another_parameter_count_is_named():
    _, funcs = binding.binding_layout()
    n = funcs["llama_sampler_init_penalties"]
    diffs = binding.abi_differences(header_like_the_binding(params={"llama_sampler_init_penalties": n - 1}))
    assert diffs == [f"llama_sampler_init_penalties takes {n - 1} parameters, the binding {n}"]


def test_header_reading_handles_function_pointers_arrays_and_multiline_declarations():
    text = """
    struct llama_sampler_i {
        const char * (*name)  (const struct llama_sampler * smpl); // comment
        bool (*backend_init)(
                struct llama_sampler * smpl,
                ggml_backend_buffer_type_t buft);
        char buf[256];
    };
    /* a block
       comment */
    LLAMA_API DEPRECATED(struct llama_sampler * llama_old(int32_t a, float b), "use llama_new");
    LLAMA_API void llama_backend_init(void);
    LLAMA_API int32_t llama_f(void (*cb)(int, int), size_t n);
    """
    assert binding.header_structs(text)["llama_sampler_i"] == ["name", "backend_init", "buf"]
    funcs = binding.header_functions(text)
    assert funcs["llama_backend_init"] == 0 and funcs["llama_f"] == 2 and funcs["llama_old"] == 2


# --- the real trees ----------------------------------------------------------------------------------

def cli(*args: object, env: dict | None = None) -> subprocess.CompletedProcess:
    import os
    e = dict(os.environ)
    e.pop(binding.ENV, None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "replay.cli", *map(str, args)], capture_output=True, text=True,
                          env=e, timeout=600)


@pytest.mark.build
def test_b11434s_own_llama_h_is_callable_through_the_binding(b11434):
    header = Path(b11434.manifest["source"]) / "include" / "llama.h"
    assert binding.abi_differences(header.read_text()) == []


@pytest.mark.build
def test_trace_replays_a_b11434_transcript_on_b11434s_own_libllama(b11434):
    r = cli("trace", TRANSCRIPT, "-m", tiny_target(), "-md", tiny_draft())
    assert r.returncode == 0, r.stderr
    lib = binding.library_file(b11434.bin_dir)
    assert f"libllama: {lib}, chosen by build_info b11434: the build's own" in r.stderr
    assert "reproduced: all" in r.stdout
    r = cli("trace", TRANSCRIPT, "-m", tiny_target(), "-md", tiny_draft(), "--json")
    assert json.loads(r.stdout)["libllama"] == str(lib.resolve())


@pytest.mark.build
def test_recover_names_its_libllama_in_the_report_and_bundled_gives_the_same_values(b11434, tmp_path):
    outs = {}
    for how in ("auto", "bundled"):
        extra = ["--libllama", "bundled"] if how == "bundled" else []
        r = cli("recover", TRANSCRIPT, "-m", tiny_target(), "-o", tmp_path / f"{how}.json",
                "--report", tmp_path / f"{how}.report.json", *extra)
        assert r.returncode == 0, r.stderr
        report = json.loads((tmp_path / f"{how}.report.json").read_text())
        outs[how] = (report["records"][0]["numerics"]["libllama"], (tmp_path / f"{how}.json").read_bytes())
    assert outs["auto"][0] == str(binding.library_file(b11434.bin_dir).resolve())
    assert outs["bundled"][0] == str(binding.bundled_dir() / "libllama.so")  # named, not null
    # b11434's ggml and 0c1e570's compute this model alike: the same repaired bytes
    assert outs["auto"][1] == outs["bundled"][1]


@pytest.mark.build
def test_a_libllama_whose_header_differs_is_refused_in_one_line(b11434, tmp_path):
    lib = binding.library_file(b11434.bin_dir)
    (tmp_path / "include").mkdir()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "libllama.so").symlink_to(lib)
    (tmp_path / "include" / "llama.h").write_text(
        header_like_the_binding(rename=("llama_context_params", "n_ctx", "n_ctx_text")))
    r = cli("trace", TRANSCRIPT, "-m", tiny_target(), "-md", tiny_draft(), "--libllama", tmp_path / "bin")
    assert r.returncode != 0
    err = [x for x in r.stderr.splitlines() if x.startswith("Error:")]
    assert len(err) == 1 and "cannot be called through llama-cpp-python's binding: struct llama_context_params" \
        in err[0], r.stderr
    assert "Traceback" not in r.stderr


def test_a_missing_libllama_is_one_line(tmp_path):
    r = cli("trace", TRANSCRIPT, "-m", tiny_target(), "-md", tiny_draft(), "--libllama", tmp_path / "nothing")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert [x for x in r.stderr.splitlines() if x.startswith("Error:")] == \
        [f"Error: --libllama {tmp_path / 'nothing'}: no libllama.so there"]
