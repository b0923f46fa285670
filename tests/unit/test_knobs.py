import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuner.model import knobs
from tuner.model.knobs import EngineArgs
from tuner.portable import argv as syntax

# --- parsing and printing ---------------------------------------------------------------------------

def test_parse_keeps_every_spelling_and_roundtrips():
    argv = ["serve", "m", "--enforce-eager", "--max-num-seqs=4", "--max_model_len", "8K", "-tp", "2",
            "--no-enable-chunked-prefill", "--gpu-memory-utilization", "0.9"]
    a = EngineArgs.parse(argv)
    assert a.argv() == argv
    assert a.get("--max-num-seqs") == "4"
    assert a.get("--max-model-len") == "8K"  # underscores are the same flag
    assert a.get("-tp") == "2"
    assert a.get("--enforce-eager") is True
    assert a.get("--enable-chunked-prefill") is False
    assert a.get("--block-size") is None
    assert not a.has("--block-size")


def test_a_boolean_flag_does_not_swallow_a_positional():
    a = EngineArgs.parse(["--enforce-eager", "my-model", "--port", "8000"])
    assert a.get("--enforce-eager") is True
    assert [i.form for i in a.items] == ["bare", "positional", "space"]


def test_negative_numbers_are_values_and_double_dash_ends_flags():
    a = EngineArgs.parse(["--chunked-prefill-size", "-1", "--", "--not-a-flag"])
    assert a.get("--chunked-prefill-size") == "-1"
    assert a.argv() == ["--chunked-prefill-size", "-1", "--", "--not-a-flag"]
    assert not a.has("--not-a-flag")


def test_unknown_flag_at_the_end_is_bare():
    assert EngineArgs.parse(["--x"]).get("--x") is True


def test_last_occurrence_wins_like_argparse():
    a = EngineArgs.parse(["--max-num-seqs", "4", "--max-num-seqs", "8"])
    assert a.get("--max-num-seqs") == "8"


def test_from_string_splits_like_a_shell_and_str_quotes_back():
    a = EngineArgs.from_string("--model '/models/my model' --max-num-seqs 4")
    assert a.get("--model") == "/models/my model"
    assert EngineArgs.from_string(str(a)).argv() == a.argv()


# --- changing ---------------------------------------------------------------------------------------

def test_with_value_replaces_in_place_and_keeps_the_spelling():
    a = EngineArgs.parse(["m", "--max-num-seqs=4", "--max_model_len", "2048", "--port", "1"])
    b = a.with_value("--max-num-seqs", 8).with_value("--max-model-len", 1024)
    assert b.argv() == ["m", "--max-num-seqs=8", "--max_model_len", "1024", "--port", "1"]
    assert a.get("--max-num-seqs") == "4"  # immutable


def test_with_value_appends_and_drops_duplicates():
    a = EngineArgs.parse(["--max-num-seqs", "4", "--max-num-seqs", "6"])
    assert a.with_value("--max-num-seqs", 8).argv() == ["--max-num-seqs", "8"]
    assert EngineArgs().with_value("--block-size", 32).argv() == ["--block-size", "32"]


def test_booleans_become_flag_or_no_flag():
    a = EngineArgs.parse(["--no-enable-chunked-prefill"])
    assert a.with_value("--enable-chunked-prefill", True).argv() == ["--enable-chunked-prefill"]
    assert EngineArgs().with_value("--enable-chunked-prefill", False).argv() == ["--no-enable-chunked-prefill"]
    assert a.with_value("--enable-chunked-prefill", None).argv() == []


def test_floats_are_printed_short():
    assert knobs.format_value(0.9400000001) == "0.94"
    assert knobs.format_value(2.0) == "2"
    assert knobs.format_value(True) == "true"


def test_fingerprint_ignores_order_and_spelling():
    a = EngineArgs.parse(["--max-num-seqs=4", "--max_model_len", "2048"])
    b = EngineArgs.parse(["--max-model-len", "2048", "--max-num-seqs", "4"])
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint() != b.with_value("--max-num-seqs", 8).fingerprint()


# --- human-readable ints ----------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "value"), [
    ("8192", 8192), ("8k", 8000), ("8K", 8192), ("25.6k", 25600), ("1m", 1_000_000), ("1M", 1048576),
    ("2g", 2_000_000_000), ("-1", -1),
])
def test_parse_int(text, value):
    assert knobs.parse_int(text) == value


@pytest.mark.parametrize("text", ["lots", "1.5K", "0.0001k", "", "8 k"])
def test_parse_int_rejects(text):
    with pytest.raises(ValueError):  # noqa: PT011
        knobs.parse_int(text)


# --- knobs and effective values ---------------------------------------------------------------------

def test_knob_for_accepts_either_engine_and_knob_names():
    assert knobs.knob_for("--max-running-requests").name == "max_num_seqs"
    assert knobs.knob_for("--max_num_seqs").name == "max_num_seqs"
    assert knobs.knob_for("max_model_len").name == "max_model_len"
    assert knobs.knob_for("--device-memory-utilization").name == "gpu_memory_utilization"
    assert knobs.knob_for("--nope") is None
    assert knobs.FLAGS["sglang"]["--context-length"].name == "max_model_len"


def test_effective_prefers_args_then_defaults_then_unknown():
    a = EngineArgs.parse(["--max-num-seqs", "4", "--max-model-len", "auto"])
    assert knobs.effective("--max-num-seqs", a) == knobs.Effective(4, "args")
    assert knobs.effective("--max-num-batched-tokens", a, defaults={"max_num_batched_tokens": 2048}).value == 2048
    e = knobs.effective("--max-num-batched-tokens", a)
    assert e.value is None and "platform" in (e.reason or "")
    mml = knobs.effective("--max-model-len", a)
    assert mml.value is None and "fitted to memory" in (mml.reason or "")
    assert knobs.effective("--max-model-len", a, defaults={"--max-model-len": 4096}).value == 4096
    bad = knobs.effective("--max-num-seqs", EngineArgs.parse(["--max-num-seqs", "lots"]))
    assert bad.value is None and "lots" in (bad.reason or "")


def test_alias_is_read():
    a = EngineArgs.parse(["--device-memory-utilization", "0.8"])
    assert knobs.effective("gpu_memory_utilization", a).value == 0.8


def test_sglang_chunked_prefill_is_chunked_prefill_size_minus_one():
    off = EngineArgs.parse(["--chunked-prefill-size", "-1"])
    assert knobs.explicit(off, "chunked_prefill", "sglang") is False
    assert knobs.explicit(off, "max_num_batched_tokens", "sglang") is None
    on = knobs.with_knob(off, "chunked_prefill", True, kind="sglang")
    assert on.argv() == []
    assert knobs.with_knob(on, "chunked_prefill", False, kind="sglang").argv() == ["--chunked-prefill-size", "-1"]
    assert knobs.with_knob(EngineArgs(), "max_num_seqs", 64, kind="sglang").argv() == [
        "--max-running-requests", "64"]
    sized = EngineArgs.parse(["--chunked-prefill-size", "4096"])
    assert knobs.explicit(sized, "chunked_prefill", "sglang") is True
    assert knobs.with_knob(sized, "chunked_prefill", True, kind="sglang") == sized


def test_with_knob_spells_the_engine_flag():
    a = knobs.with_knob(EngineArgs(), "chunked_prefill", True)
    assert a.argv() == ["--enable-chunked-prefill"]
    assert knobs.with_knob(a, "gpu_memory_utilization", 0.94).argv()[-1] == "0.94"
    with pytest.raises(KeyError):
        knobs.with_knob(a, "--nope", 1)


def test_documented_defaults():
    assert knobs.documented_defaults(platform="cpu", parallel=2) == {
        "chunked_prefill": True, "max_num_seqs": 256, "max_num_batched_tokens": 4096, "block_size": 128}
    h200 = knobs.documented_defaults(platform="cuda", gpu_memory_gib=139)
    assert (h200["max_num_seqs"], h200["max_num_batched_tokens"]) == (1024, 8192)
    a100 = knobs.documented_defaults(platform="cuda", gpu_memory_gib=80, gpu_name="NVIDIA A100-SXM4-80GB")
    assert (a100["max_num_seqs"], a100["max_num_batched_tokens"]) == (256, 2048)
    b200 = knobs.documented_defaults(platform="cuda", gpu_memory_gib=180)
    assert b200["max_num_batched_tokens"] == 16384
    assert "max_num_seqs" not in knobs.documented_defaults(platform="cuda")  # memory unknown
    assert knobs.documented_defaults("sglang", platform="cpu") == {"chunked_prefill": True}


def test_parse_defaults_and_merge():
    assert knobs.parse_defaults(["--max-num-seqs=1k", "block_size=16"]) == {"max_num_seqs": 1000, "block_size": 16}
    with pytest.raises(ValueError, match="FLAG=VALUE"):
        knobs.parse_defaults(["--nope=1"])
    assert knobs.merged_defaults({"--block-size": 16}, None, {"block_size": 32}) == {"block_size": 32}


def test_changed_knobs():
    a = EngineArgs.parse(["--max-num-seqs", "4"])
    assert knobs.changed_knobs(a, a.with_value("--max-num-seqs", 8)) == ["max_num_seqs"]
    assert knobs.changed_knobs(a, a) == []


# --- validation -------------------------------------------------------------------------------------

def _problems(text, platform=None, **defaults):
    return knobs.validate(EngineArgs.from_string(text), "vllm", platform=platform, defaults=defaults or None)


def test_valid_command_line_has_no_problems():
    assert _problems("--max-num-seqs 256 --max-num-batched-tokens 8192 --max-model-len 32k --block-size 32",
                     "cuda") == []


def test_batched_tokens_below_max_num_seqs_is_refused_always():
    (p,) = _problems("--max-num-seqs 256 --max-num-batched-tokens 128")
    assert "--max-num-batched-tokens 128 < --max-num-seqs 256" in p and "refuses to start" in p
    # also when max-num-seqs comes from a default
    assert _problems("--max-num-batched-tokens 128", max_num_seqs=256)


def test_batched_tokens_below_max_model_len_only_with_chunked_prefill_off():
    assert _problems("--max-num-batched-tokens 2048 --max-model-len 4096") == []
    (p,) = _problems("--no-enable-chunked-prefill --max-num-batched-tokens 2048 --max-model-len 4096")
    assert "chunked prefill off" in p
    # a defaulted budget is raised by vLLM itself
    assert _problems("--no-enable-chunked-prefill --max-model-len 4096", max_num_batched_tokens=2048) == []


@pytest.mark.parametrize(("platform", "size", "ok"), [
    ("cuda", 16, True), ("cuda", 32, True), ("cuda", 24, False), ("cuda", 256, True),
    ("cuda-flashinfer", 64, True), ("cuda-flashinfer", 128, False), ("cuda-flashmla", 32, False),
    ("cpu", 24, True), (None, 24, True),
])
def test_block_size_per_platform(platform, size, ok):
    problems = _problems(f"--block-size {size}", platform)
    assert (problems == []) is ok
    assert knobs.block_size_ok(size, platform) is ok
    if not ok:
        assert platform in problems[0]


def test_memory_fraction_and_positive_ints():
    assert "(0, 1]" in _problems("--gpu-memory-utilization 1.2")[0]
    assert "(0, 1]" in _problems("--gpu-memory-utilization 0")[0]
    assert _problems("--gpu-memory-utilization 1") == []
    assert "positive" in _problems("--max-num-seqs 0")[0]
    assert "not an integer" in _problems("--max-num-seqs lots")[0]
    assert "needs a value" in knobs.validate(EngineArgs.parse(["--max-num-seqs"]), platform=None)[0]


def test_max_num_active_seqs():
    assert "refuses" in _problems("--max-num-seqs 8 --max-num-active-seqs 16")[0]
    assert _problems("--max-num-seqs 8 --max-num-active-seqs 4") == []
    assert "not an integer" in _problems("--max-num-seqs 8 --max-num-active-seqs x")[0]


def test_sglang_validation_skips_vllm_scheduler_rules():
    args = EngineArgs.from_string("--max-running-requests 256 --chunked-prefill-size 128 --mem-fraction-static 2")
    (p,) = knobs.validate(args, "sglang", platform=None)
    assert "--mem-fraction-static" in p


# --- property: any argv survives parse → argv ---------------------------------------------------------

_token = st.one_of(
    st.sampled_from(["--max-num-seqs", "--enforce-eager", "--no-enable-chunked-prefill", "-tp", "--", "-1",
                     "--max-model-len=8k", "model", "--x"]),
    st.text(alphabet="abc-=_019.", min_size=1, max_size=6),
)


@given(st.lists(_token, max_size=12))
def test_parse_argv_roundtrip(argv):
    assert EngineArgs.parse(argv).argv() == argv


_queried = st.sampled_from(["--max-num-seqs", "--max_num_seqs", "--enforce-eager", "--no-enforce-eager",
                            "--no-enable-chunked-prefill", "-tp", "--x", "--a", "--b-c", "--b_c", "--no-a", "--no-b-c",
                            "--no_b_c", "--"])


_few_flags = st.sampled_from(["--a", "--no-a", "--a=1", "--no_a", "--b_c", "--b-c=2", "--no-b-c", "1", "v", "--",
                              "--enforce-eager", "--no-enforce-eager", "-tp"])


@given(st.lists(_few_flags | _token, max_size=12),
       st.lists(_queried | st.text(alphabet="abc-_", min_size=1, max_size=5), min_size=1, max_size=6))
def test_the_index_of_a_command_line_reads_what_a_scan_reads(argv, flags):
    """EngineArgs reads a flag from an index built once per command line: the same item as the launcher's scan
    (``argv.find``: the last one, ``--no-`` forms and either spelling included), so the same value."""
    a = EngineArgs.parse(argv)
    for flag in flags:
        assert a._find(flag) == syntax.find(a.items, flag), (argv, flag)
        at = syntax.find(a.items, flag)
        assert a.has(flag) == (at is not None)
    for flag in flags:  # read again: from the index now built
        at = syntax.find(a.items, flag)
        if at is None:
            assert a.get(flag) is None
        elif a.items[at].form == "bare":
            key = a.items[at].key or ""
            assert a.get(flag) == (not key.startswith("--no-") or syntax.normalize(flag).startswith("--no-"))
        else:
            assert a.get(flag) == a.items[at].value
    assert EngineArgs.parse(argv) == a and hash(EngineArgs.parse(argv)) == hash(a)  # the index is no part of it


# --- hard sanity ranges -------------------------------------------------------------------------------

def test_every_numeric_knob_has_a_hard_range_and_booleans_none():
    for knob in knobs.KNOBS.values():
        if knob.type == "bool":
            assert knob.range is None
        else:
            assert knob.range is not None and knob.range.why, knob.name
    assert knobs.KNOBS["max_num_seqs"].range.contains(65536) and not knobs.KNOBS["max_num_seqs"].range.contains(65537)
    gmu = knobs.KNOBS["gpu_memory_utilization"].range
    assert gmu.contains(1.0) and gmu.contains(0.01) and not gmu.contains(0.0) and not gmu.contains(1.0001)


@pytest.mark.parametrize(("text", "needle"), [
    ("--max-num-seqs 4000000000", "--max-num-seqs"),           # a rule's factor: 1e9 on 4
    ("--max-num-batched-tokens 20000000", "--max-num-batched-tokens"),
    ("--max-model-len 100000000", "--max-model-len"),
    ("--block-size 4096", "--block-size"),
    ("--max-num-seqs " + "9" * 400, "--max-num-seqs"),         # not even a float
])
def test_values_outside_the_hard_range_are_refused(text, needle):
    (p,) = _problems(text)
    assert p.startswith(needle) and "outside" in p


def test_an_out_of_range_value_on_the_command_line_is_unknown_not_a_number():
    e = knobs.effective("--max-num-seqs", EngineArgs.parse(["--max-num-seqs", "9" * 400]))
    assert e.value is None and e.source == "unknown" and "outside" in (e.reason or "")
    assert knobs.effective("--max-num-seqs", EngineArgs.parse(["--max-num-seqs", "65536"])).value == 65536


def test_sglang_flags_share_the_ranges():
    (p,) = knobs.validate(EngineArgs.from_string("--max-running-requests 100000"), "sglang", platform=None)
    assert "--max-running-requests" in p and "outside" in p


_knob_tokens = st.sampled_from(["--max-num-seqs", "--max-num-batched-tokens", "--max-model-len", "--block-size",
                                "--no-enable-chunked-prefill", "--gpu-memory-utilization", "--max-num-active-seqs",
                                "4", "16", "8k", "0.9", "2", "lots", "-1", "auto"])


@given(st.lists(_knob_tokens, max_size=10), st.sampled_from(["vllm", "sglang"]), st.sampled_from([None, "cuda", "cpu"]),
       st.none() | st.dictionaries(st.sampled_from(["max_num_seqs", "max_model_len", "block_size", "chunked_prefill",
                                                    "gpu_memory_utilization"]),
                                   st.sampled_from([1, 1.0, True, False, 16, 4096, 1.5, 0.9, float("nan")]), max_size=3))
def test_validate_answers_what_it_computes_whenever_it_is_asked(argv, kind, platform, defaults):
    """``validate`` keeps its answers: the same as computing them, every time, defaults of equal value but another
    type (True, 1, 1.0) included."""
    args = EngineArgs.parse(argv)
    expected = knobs._checked(args, kind, platform=platform, defaults=defaults)
    for _ in range(2):
        assert knobs.validate(args, kind, platform=platform, defaults=defaults) == expected
    if defaults:  # another type of one default's value: asked after, it is answered for itself
        other = {k: (float(v) if isinstance(v, bool) else bool(v)) for k, v in defaults.items()}
        assert knobs.validate(args, kind, platform=platform, defaults=other) == knobs._checked(
            args, kind, platform=platform, defaults=other)
