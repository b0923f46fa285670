"""The one argv writer (``tuner.portable.argv``) and the pod's protocol, pure. The launcher patches its
engine's command line with it, and ``EngineArgs`` writes through it: the table below and a property test
hold the two entry points to the same answers, and a structural test holds that ``EngineArgs`` has no
writer of its own."""

from __future__ import annotations

import ast
import json
import re
import sys
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tuner.model import knobs
from tuner.portable import argv as argvs
from tuner.portable import pod_protocol as protocol
from tuner.portable import secrets as launcher_secrets

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


def test_engineargs_builds_no_argv_item_of_its_own():
    """One writer: no module of tuner/model constructs an argv ``Item`` (issue 29: ``model/knobs.py`` once
    repeated the launcher's writer line for line)."""
    model = Path(knobs.__file__).resolve().parent
    makers = [f"{p.name}:{node.lineno}" for p in sorted(model.glob("*.py")) for node in ast.walk(ast.parse(p.read_text()))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute)
              and (node.func.id if isinstance(node.func, ast.Name) else node.func.attr) == "Item"]
    assert not makers, makers


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


# --- allowed-flags.json: what an override may set ------------------------------------------------------

ALLOWED = protocol.Allowed({"--max-num-seqs": protocol.Bound("int", 1, 1024),
                            "--gpu-memory-utilization": protocol.Bound("float", 0.5, 0.95),
                            "--enable-chunked-prefill": protocol.Bound("bool"),
                            "--chunked-prefill-size": protocol.Bound("int", 64, 8192, also=("-1",), removable=True)})


@pytest.mark.parametrize(("overrides", "why"), [
    ([("--max-num-seqs", "64")], None),
    ([("--max_num_seqs", "1024")], None),  # vLLM's other spelling is the same flag
    ([("--gpu-memory-utilization", "0.9")], None),
    ([("--enable-chunked-prefill", False)], None),
    ([("--chunked-prefill-size", "-1")], None),
    ([("--chunked-prefill-size", None)], None),
    ([("--max-num-seqs", "8"), ("--max-num-seqs", "16")], None),
    ([("--trust-remote-code", True)], "--trust-remote-code is not a flag the rules may change"),
    ([("--model", "evil/model")], "--model is not a flag"),
    ([("--max-num-seqs", "8"), ("--trust-remote-code", True)], "overrides[1]: --trust-remote-code"),  # all or nothing
    ([("--no-enable-chunked-prefill", True)], "is not a flag"),  # --no- forms are [flag, false]
    ([("--max-num-seqs=8", "8")], "is not a flag"),
    ([("--max-num-seqs", "0")], "'0' is outside [1, 1024]"),
    ([("--max-num-seqs", "1025")], "outside"),
    ([("--max-num-seqs", "8"), ("--max-num-seqs", "99999")], "overrides[1]: --max-num-seqs '99999' is outside"),
    ([("--max-num-seqs", "--trust-remote-code")], "takes an integer as the tuner writes it"),  # a flag as a value
    ([("--max-num-seqs", "8 --trust-remote-code")], "takes an integer"),
    ([("--max-num-seqs", "-8")], "takes an integer"),
    ([("--max-num-seqs", "8.0")], "takes an integer"),
    ([("--max-num-seqs", "1e3")], "takes an integer"),
    ([("--max-num-seqs", " 8")], "takes an integer"),
    ([("--max-num-seqs", "８")], "takes an integer"),  # a full-width digit: not what the tuner writes
    ([("--max-num-seqs", True)], "takes a number, not true"),
    ([("--max-num-seqs", None)], "may not be removed"),
    ([("--gpu-memory-utilization", "nan")], "takes a number"),
    ([("--gpu-memory-utilization", "1.5")], "outside [0.5, 0.95]"),
    ([("--enable-chunked-prefill", "true")], "takes true or false only"),
    ([("--chunked-prefill-size", "-2")], "takes an integer"),
])
def test_only_allowed_flags_inside_their_bounds_pass(overrides, why):
    refusal = ALLOWED.refusal(overrides)
    assert refusal is None if why is None else (refusal is not None and why in refusal), refusal


def test_a_refusal_never_quotes_a_value_it_does_not_know_to_be_a_number():
    refusal = ALLOWED.refusal([("--max-num-seqs", "hf_s3cret_token")])
    assert refusal is not None and "s3cret" not in refusal and "str of length 15" in refusal
    long_flag = "--" + "x" * 500
    refusal = ALLOWED.refusal([(long_flag, "1")])
    assert refusal is not None and len(refusal) < 400


flag_names = st.one_of(st.sampled_from(["--max-num-seqs", "--max_num_seqs", "--trust-remote-code", "--model",
                                        "--enable-chunked-prefill", "--no-enable-chunked-prefill", "--port",
                                        "--chunked-prefill-size", "--gpu-memory-utilization", "--host"]),
                       st.from_regex(r"--[a-z][a-z_-]{0,20}", fullmatch=True))
override_values = st.one_of(st.none(), st.booleans(), st.integers(-5, 3000).map(str),
                            st.sampled_from(["0.9", "0.49", "-1", "--trust-remote-code", "8 9", "", "0x10", "1e2"]),
                            st.text(max_size=8))
# mostly pairs near what passes (the allowed flags, values on both sides of their bounds), some of anything
near_allowed = st.one_of(
    st.tuples(st.sampled_from(["--max-num-seqs", "--max_num_seqs"]), st.integers(-1, 1100).map(str)),
    st.tuples(st.just("--gpu-memory-utilization"), st.sampled_from(["0.5", "0.9", "0.95", "0.951", "0.49", ".9"])),
    st.tuples(st.just("--enable-chunked-prefill"), st.one_of(st.booleans(), st.none())),
    st.tuples(st.just("--chunked-prefill-size"), st.one_of(st.none(), st.just("-1"), st.integers(0, 9000).map(str))))
pairs = st.one_of(near_allowed, near_allowed, near_allowed, st.tuples(flag_names, override_values))
BASE_LINE = ["vllm", "serve", "/m", "--max-num-seqs", "4", "--port", "8000", "--enable-chunked-prefill", "--host",
             "0.0.0.0"]


@settings(max_examples=500, deadline=None)
@given(st.lists(pairs, min_size=1, max_size=4))
def test_whatever_passes_changes_only_allowed_flags_to_allowed_values(overrides):
    """The property the allow-list is for: a set of overrides that passes makes a command line that differs
    from the base only in allowed flags, each with a value inside its bounds — whatever the pairs (repeated
    flags, values that look like flags, other spellings)."""
    if ALLOWED.refusal(overrides) is not None:
        return
    base = {i.key: i for i in argvs.parse(BASE_LINE) if i.key is not None}
    result = argvs.parse(argvs.apply(BASE_LINE, overrides))
    assert [i.value for i in result if i.key is None] == ["vllm", "serve", "/m"]  # no positional added or moved
    for item in result:
        if item.key is None or base.get(item.key) == item:
            continue
        key = item.key[:2] + item.key[5:] if item.key.startswith("--no-") else item.key
        bound = ALLOWED.flags.get(key)
        assert bound is not None, f"{item.key} changed: {overrides}"
        value: argvs.Value = (not item.key.startswith("--no-")) if item.form == "bare" else item.value
        assert bound.problem(value) is None, (item, overrides)


def test_the_allow_list_file_roundtrips_and_a_malformed_one_is_one_clear_line(tmp_path):
    protocol.write_allowed(tmp_path, ALLOWED)
    assert protocol.read_allowed(tmp_path) == ALLOWED
    assert protocol.read_allowed(tmp_path / "nowhere") is None
    for doc, message in [({"v": 1}, "expected an object"),
                         ({"v": 1, "flags": {"x": {"type": "int"}}}, "a --long-flag"),
                         ({"v": 1, "flags": {"--x": {"type": "str"}}}, "type must be bool, int or float"),
                         ({"v": 1, "flags": {"--x": {"type": "int", "min": 1}}}, "give both min and max"),
                         ({"v": 1, "flags": {"--x": {"type": "int", "min": True, "max": 2}}}, "min must be a number")]:
        with pytest.raises(protocol.ProtocolError, match=re.escape(message)):
            protocol.parse_allowed(json.dumps(doc))


# --- the launcher stays stdlib-only ------------------------------------------------------------------

PORTABLE = Path(protocol.__file__).resolve().parent
LAUNCHER = PORTABLE.parent / "launcher"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


@pytest.mark.parametrize("package", [LAUNCHER, PORTABLE], ids=["launcher", "portable"])
def test_every_import_is_the_standard_library_itself_or_the_ground_floor(package):
    """The launcher imports the standard library, itself (``from . import``) and the ground floor (``from
    ..portable import``); the ground floor the standard library and itself: relative imports, so that the
    zipapp's ``vllm_tuner_launcher/`` holds both as ``tuner/`` does."""
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level == 1:  # itself
                    continue
                assert node.level == 0 or (package == LAUNCHER and node.level == 2 and node.module == "portable"), \
                    f"{path.name} imports {'.' * node.level}{node.module or ''}"
                names = [node.module or ""] if node.level == 0 else []
            else:
                continue
            for name in names:
                assert name.split(".")[0] in sys.stdlib_module_names, f"{path.name} imports {name}"


@pytest.mark.parametrize("package", ["tuner.launcher", "tuner.portable"])
def test_the_import_linter_allow_list_holds_only_the_standard_library(package):
    contracts = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    allow = next(c for c in contracts if c.get("source_modules") == [package] and c.get("forbidden_modules") == ["*"])
    modules = [entry.split("->")[1].strip() for entry in allow["ignore_imports"]]
    outside = [m for m in modules if m != "tuner.portable.**"]  # the launcher's ground floor, held by its own list
    assert outside and all(m in sys.stdlib_module_names for m in outside), modules
