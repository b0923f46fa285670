"""model/secrets.py: what is secret in an engine's command line and environment, masking that keeps a
command line's shape, and putting the real values back from the configuration."""

from __future__ import annotations

import json
import subprocess

import pytest

from harness import vllm
from tuner.model import knobs, secrets

R = secrets.DEFAULT
KEY = "sk-live-0123456789"


@pytest.mark.parametrize(("argv", "masked"), [
    (["--model", "m", "--api-key", KEY], ["--model", "m", "--api-key", "***"]),
    (["--api-key=" + KEY, "--port", "8000"], ["--api-key=***", "--port", "8000"]),
    (["--api_key", KEY], ["--api_key", "***"]),  # vLLM reads underscores as dashes
    (["--api-key", "k1", "k2", "--max-num-seqs", "8"], ["--api-key", "***", "***", "--max-num-seqs", "8"]),  # nargs=+
    (["--hf-token", "--model", "m"], ["--hf-token", "--model", "m"]),  # bare: the stored login, nothing to mask
    (["--hf-token", "hf_abc", "m"], ["--hf-token", "***", "m"]),  # at most one value
    (["--watermark-config", '{"key": 42}'], ["--watermark-config", "***"]),
    (["--admin-api-key", "adm"], ["--admin-api-key", "***"]),  # SGLang
    (["--", "--api-key", KEY], ["--", "--api-key", KEY]),  # positional after --: not an option
    (["--max-num-seqs", "-1"], ["--max-num-seqs", "-1"]),
])
def test_masking_keeps_the_shape_of_the_command_line(argv: list[str], masked: list[str]) -> None:
    assert R.argv(argv) == masked
    assert R.restore(masked, argv) == argv  # and the configuration's values come back


def test_restore_takes_each_value_from_the_reference_in_order_and_refuses_a_missing_one() -> None:
    configured = ["--api-key", "k1", "k2", "--max-num-seqs", "8", "--api-key=k3"]
    changed = knobs.EngineArgs.parse(R.argv(configured)).with_value("--max-num-seqs", 16).argv()
    assert R.restore(changed, configured) == ["--api-key", "k1", "k2", "--max-num-seqs", "16", "--api-key=k3"]
    with pytest.raises(ValueError, match="--api-key"):
        R.restore(["--api-key", "***"], ["--model", "m"])
    assert R.restore(["--api-key", "real"], []) == ["--api-key", "real"]  # nothing masked: nothing to restore


def test_secret_environment_names_known_and_by_word() -> None:
    env = {"HF_TOKEN": "hf_x", "VLLM_API_KEY": "k", "AWS_SECRET_ACCESS_KEY": "a", "MY_DB_PASSWORD": "p",
           "SERVICE_CREDENTIALS": "c", "TOKENIZERS_PARALLELISM": "false", "PATH": "/bin", "MAX_TOKENS": "9"}
    assert R.env(env) == {"HF_TOKEN": "***", "VLLM_API_KEY": "***", "AWS_SECRET_ACCESS_KEY": "***",
                          "MY_DB_PASSWORD": "***", "SERVICE_CREDENTIALS": "***", "TOKENIZERS_PARALLELISM": "false",
                          "PATH": "/bin", "MAX_TOKENS": "9"}
    extra = R.extended(env=["REGISTRY_PULL"], flags=["--kv-transfer-config"])
    assert extra.env({"REGISTRY_PULL": "x"}) == {"REGISTRY_PULL": "***"}
    assert extra.argv(["--kv-transfer-config", "{}"]) == ["--kv-transfer-config", "***"]


def test_free_text_loses_known_values_and_recognisable_patterns() -> None:
    r = R.learn(argvs=[["--api-key", KEY]], env={"HF_TOKEN": "hf_envsecret"}, urls=["http://u:pa55word@h/m?token=qtok99"])
    text = (f"runs ['--api-key', 'other-key'] and --api_key=zz; key {KEY} in a reason; HF_TOKEN=hf_envsecret; "
            "Authorization: Bearer abc.def; {'api_key': ['x1']}; \"password\": \"p\"; GET /m?token=qtok99")
    out = r.text(text)
    for secret in (KEY, "other-key", "zz;", "hf_envsecret", "abc.def", "x1", '"p"', "qtok99", "pa55word"):
        assert secret not in out, (secret, out)
    assert out.count("***") == 8, out
    # ordinary text is left alone (config keys that merely contain a word, short secrets are not searched for)
    plain = '"bearer_token_file": null, "secret_flags": [], "keep_warm_max_tokens": 1, TOKENIZERS_PARALLELISM=false'
    assert R.learn(values=["abc"]).text(plain + " abc") == plain + " abc"


def test_documents_are_masked_by_structure_and_by_value() -> None:
    r = R.learn(argvs=[["--api-key", KEY]])
    doc = {"args": ["--model", "m", "--api-key", KEY], "current_args": {"--api-key": KEY, "--max-num-seqs": "8"},
           "env": {"HF_TOKEN": "t", "PATH": "/bin"}, "reason": f"the process runs --api-key {KEY}", "n": 3,
           "nested": [{"old_argv": {"a": ["--api-key=" + KEY]}}]}
    out = r.data(doc)
    assert KEY not in json.dumps(out)
    assert out["args"] == ["--model", "m", "--api-key", "***"] and out["current_args"]["--max-num-seqs"] == "8"
    assert out["env"] == {"HF_TOKEN": "***", "PATH": "/bin"} and out["n"] == 3
    assert r.data({"signals": {"generation_tokens_per_s": 1.5, "kv_cache_usage": 0.2}}) == \
        {"signals": {"generation_tokens_per_s": 1.5, "kv_cache_usage": 0.2}}


def test_fingerprint_pairs_are_masked_and_restored_from_the_configuration() -> None:
    configured = ["--model", "m", "--api-key", "k1-longer", "k2-longer"]
    r = R.learn(argvs=[configured])
    bad = knobs.EngineArgs.parse(configured).with_value("--max-model-len", 8192).fingerprint()
    masked = r.pairs(bad)
    assert "k1-longer" not in json.dumps(masked) and "k2-longer" not in json.dumps(masked)
    back = r.restore_pairs(masked, knobs.EngineArgs.parse(configured).fingerprint())
    assert tuple(sorted(tuple(p) for p in back)) == bad


def test_url_secrets() -> None:
    assert secrets.url_secrets("http://user:pw@h:1/metrics?token=t1&a=1&api_key=k#x") == ["pw", "t1", "k"]
    assert secrets.url_secrets("{url}/drain?name={name}") == []


def test_digest_tells_command_lines_apart() -> None:
    assert secrets.digest(["--api-key", "a"]) != secrets.digest(["--api-key", "b"])
    assert secrets.digest(("x",)) == secrets.digest(["x"])


@pytest.mark.slow  # vLLM's own parser, imported in .venv-vllm
def test_the_flags_vllm_itself_redacts_are_secret_flags_here() -> None:
    """vLLM 0.32 masks api_key, hf_token and watermark_config in its own log (``_SENSITIVE_ARG_FIELDS``):
    every option of its server parser that sets one of those is in ``secrets.FLAGS``."""
    py = vllm.vllm_python()
    if py is None:
        pytest.skip(vllm.skip_reason() or "no .venv-vllm")
    code = ("import json\nfrom vllm.utils.argparse_utils import FlexibleArgumentParser\n"
            "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
            "from vllm.entrypoints.serve.utils.api_utils import _SENSITIVE_ARG_FIELDS\n"
            "p = make_arg_parser(FlexibleArgumentParser())\n"
            "print(json.dumps(sorted(o for a in p._actions if a.dest in _SENSITIVE_ARG_FIELDS "
            "for o in a.option_strings if o.startswith('--'))))\n")
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300, check=True)
    options = json.loads(out.stdout.strip().splitlines()[-1])
    assert options, out.stderr[-2000:]
    assert set(options) <= set(secrets.FLAGS), options


@pytest.mark.slow  # vLLM's own parser, imported in .venv-vllm
def test_a_vllm_flag_named_like_a_credential_is_secret_if_it_takes_a_value() -> None:
    """``FLAG_NAME`` masks flags only named like a credential: on vLLM 0.32's real parser, every such
    option that takes a value is secret here, and every switch (``--allow-credentials``) is not."""
    py = vllm.vllm_python()
    if py is None:
        pytest.skip(vllm.skip_reason() or "no .venv-vllm")
    code = ("import json\nfrom vllm.utils.argparse_utils import FlexibleArgumentParser\n"
            "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
            "p = make_arg_parser(FlexibleArgumentParser())\n"
            "print(json.dumps([[o, a.nargs == 0] for a in p._actions for o in a.option_strings "
            "if o.startswith('--')]))\n")
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300, check=True)
    options = json.loads(out.stdout.strip().splitlines()[-1])
    named = [(o, switch) for o, switch in options if secrets.FLAG_NAME.search(o)]
    assert named, out.stderr[-2000:]
    for option, switch in named:
        assert secrets.DEFAULT.is_secret_flag(option) is not switch, option


@pytest.mark.parametrize("mode", ["recommend", "apply"])
def test_the_daemons_documents_without_secrets_pass_through_unchanged(mode: str) -> None:
    """No false positives where it matters: masking /status, /recommendations and a cycle's log record
    of a configuration without secrets changes nothing (signal names with 'tokens', reasons, plans)."""
    from tests.unit.test_cycle import Harness
    from tuner.runtime import views

    h = Harness(mode)
    h.run()
    result = h.run()
    for doc in (views.status(result), views.recommendations(result), views.record(result)):
        plain = json.loads(json.dumps(doc, default=str))
        assert R.data(plain) == plain
    assert R.text(result.summary) == result.summary
