"""The launcher's argv patcher and its protocol, pure. The launcher keeps its own copy of
``knobs.EngineArgs.with_value`` (it may import only the standard library): the table below holds the two
to the same answers, and a property test to the same answers on generated command lines."""

from __future__ import annotations

import ast
import json
import sys
import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuner.launcher import argv as argvs
from tuner.launcher import protocol
from tuner.launcher import secrets as launcher_secrets
from tuner.model import knobs

BASE = ["vllm", "serve", "/models/m", "--host", "0.0.0.0", "--port", "8000", "--max-num-seqs", "4",
        "--max_model_len=2048", "--enforce-eager", "--no-enable-prefix-caching", "-tp", "2"]

CASES = [
    (BASE, "--max-num-seqs", "8"),                      # replaced in place, space form
    (BASE, "--max-model-len", "4096"),                  # --max_model_len=2048: spelling and = form kept
    (BASE, "--block-size", "32"),                       # appended
    (BASE, "--enable-prefix-caching", True),            # --no-enable-prefix-caching → --enable-prefix-caching
    (BASE, "--enforce-eager", False),                   # --enforce-eager → --no-enforce-eager
    (BASE, "--enable-chunked-prefill", False),          # appended as --no-enable-chunked-prefill
    (BASE, "--max-num-seqs", None),                     # removed
    (BASE, "--enforce-eager", None),
    (BASE, "--gpu-memory-utilization", True),           # not a boolean flag: "true"
    (BASE, "--chunked-prefill-size", "-1"),             # a negative value
    (["vllm", "serve", "m", "--max-num-seqs", "4", "--max-num-seqs", "6"], "--max-num-seqs", "8"),  # duplicates
    (["--enable-prefix-caching", "model", "--port", "1"], "--port", "2"),  # bare boolean before a positional
    (["serve", "m", "--", "--max-num-seqs", "4"], "--max-num-seqs", "8"),  # after -- is positional
    ([], "--max-num-seqs", "8"),
]


@pytest.mark.parametrize(("base", "flag", "value"), CASES)
def test_the_launcher_patches_argv_as_engineargs_does(base, flag, value):
    expected = knobs.EngineArgs.parse(base).with_value(flag, value).argv()
    assert argvs.apply(base, [(flag, value)]) == expected


def test_several_overrides_apply_in_order():
    overrides = [("--max-num-seqs", "64"), ("--max-num-batched-tokens", "8192"), ("--max-num-seqs", "32")]
    expected = knobs.EngineArgs.parse(BASE)
    for flag, value in overrides:
        expected = expected.with_value(flag, value)
    assert argvs.apply(BASE, overrides) == expected.argv()
    assert argvs.value_of(argvs.apply(BASE, overrides), "--max-num-seqs") == "32"


tokens = st.sampled_from(["--max-num-seqs", "--max_num_seqs", "--enforce-eager", "--no-enforce-eager",
                          "--block-size=16", "4", "model", "-tp", "-1", "--", "--x", "serve"])
values = st.one_of(st.none(), st.booleans(), st.sampled_from(["8", "-1", "auto", "0.9"]))


@given(st.lists(tokens, max_size=10), st.sampled_from(["--max-num-seqs", "--enforce-eager", "--block-size", "--x"]),
       values)
def test_agreement_on_generated_command_lines(base, flag, value):
    assert argvs.apply(base, [(flag, value)]) == knobs.EngineArgs.parse(base).with_value(flag, value).argv()


@given(st.lists(tokens, max_size=10))
def test_the_tuner_reads_a_command_line_with_the_launchers_reader(argv):
    assert knobs.EngineArgs.parse(argv).items == tuple(argvs.parse(argv))  # one reader, not two copies


def test_base_hash_is_of_the_exact_argv():
    assert argvs.sha256(BASE) == argvs.sha256(list(BASE))
    assert argvs.sha256(BASE) != argvs.sha256([*BASE, "--seed", "0"])
    assert argvs.sha256(["a b"]) != argvs.sha256(["a", "b"])  # no shell-style joining
    assert len(argvs.sha256(BASE)) == 64


def test_secrets_are_redacted_for_display_only():
    argv = ["vllm", "serve", "m", "--api-key", "s3cret", "--hf-token=hf_x", "--max-num-batched-tokens", "8192",
            "--ssl-keyfile", "/k.pem"]
    shown = launcher_secrets.DEFAULT.argv(argv)  # the one secrets module, the tuner's mask
    assert "s3cret" not in shown and "--hf-token=hf_x" not in shown
    assert shown[3:6] == ["--api-key", "***", "--hf-token=***"]
    assert shown[6:] == ["--max-num-batched-tokens", "8192", "--ssl-keyfile", "/k.pem"]


# --- desired.json ---------------------------------------------------------------------------------

SHA = "a" * 64


def test_a_desired_document_roundtrips(tmp_path):
    written = protocol.write_desired(tmp_path, generation=3, overrides=[("--max-num-seqs", "64"),
                                                                        ("--enforce-eager", False)],
                                     base_sha256=SHA, drain=True)
    read = protocol.read_desired(tmp_path / protocol.DESIRED)
    assert read == written
    assert read.overrides == (("--max-num-seqs", "64"), ("--enforce-eager", False)) and read.drain
    assert not list(tmp_path.glob(".*tmp"))  # the temporary file was renamed, not left behind


def test_no_desired_file_is_no_request(tmp_path):
    assert protocol.read_desired(tmp_path / protocol.DESIRED) is None


@pytest.mark.parametrize(("doc", "message"), [
    ("not json", "not valid JSON"),
    ([], "must be an object"),
    ({"v": 2, "generation": 1}, "v must be 1"),
    ({"v": 1, "generation": -1}, "generation must be an integer"),
    ({"v": 1, "generation": True}, "generation must be an integer"),
    ({"v": 1, "generation": 1, "overrides": {"--x": "1"}}, "list of [flag, value] pairs"),
    ({"v": 1, "generation": 1, "overrides": [["--x"]], "base_sha256": SHA}, "overrides[0] must be [flag, value]"),
    ({"v": 1, "generation": 1, "overrides": [["x", "1"]], "base_sha256": SHA}, "not a --long-flag"),
    ({"v": 1, "generation": 1, "overrides": [["--x; rm -rf /", "1"]], "base_sha256": SHA}, "not a --long-flag"),
    ({"v": 1, "generation": 1, "overrides": [["--x", 8]], "base_sha256": SHA}, "must be a string, true, false or null"),
    ({"v": 1, "generation": 1, "overrides": [["--x", "1"]]}, "need base_sha256"),
    ({"v": 1, "generation": 1, "base_sha256": "xyz"}, "64 lower-case hex"),
    ({"v": 1, "generation": 1, "drain": "yes"}, "drain must be true or false"),
])
def test_a_malformed_desired_document_is_one_clear_line(doc, message):
    text = doc if isinstance(doc, str) else json.dumps(doc)
    with pytest.raises(protocol.ProtocolError, match=message.replace("[", r"\[").replace("]", r"\]")) as info:
        protocol.parse_desired(text)
    assert "\n" not in str(info.value)


# --- the launcher stays stdlib-only ------------------------------------------------------------------

LAUNCHER = Path(protocol.__file__).resolve().parent
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_every_launcher_import_is_the_standard_library_or_itself():
    for path in sorted(LAUNCHER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: the launcher itself
                    continue
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in sys.stdlib_module_names, f"{path.name} imports {name}"


def test_the_import_linter_allow_list_holds_only_the_standard_library():
    contracts = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    allow = next(c for c in contracts if c.get("source_modules") == ["tuner.launcher"] and c.get("forbidden_modules") == ["*"])
    modules = [entry.split("->")[1].strip() for entry in allow["ignore_imports"]]
    assert modules and all(m in sys.stdlib_module_names for m in modules), modules
