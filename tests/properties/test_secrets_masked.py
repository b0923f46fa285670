"""Class 5 of issue 17: secrets are masked at the source, with one list, one mask and one digest.

Generated command lines put generated secrets behind every secret flag the engines know — ``--api-key``
with one to three keys, ``--watermark-config`` (a JSON document), ``--hf-token``, flags only named like
one (``--db-password``) — in both the ``--flag value`` and the ``--flag=value`` form. Generated log
lines and bodies carry those secrets in every encoding they can take (as written, percent-encoded,
JSON-escaped, base64; ``user:password`` base64 as in a Basic header). The promise: no secret, in any of
its encodings, survives the launcher's or the tuner's masking; a body is described, never quoted;
a token file that is not one line is refused by the check ``check-config`` and ``run`` share, without
showing any line of it.
"""

from __future__ import annotations

import base64
import json
import string
import urllib.parse
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tuner import config
from tuner.errors import ConfigError
from tuner.model import secrets, snapshots
from tuner.portable import argv as argvs
from tuner.portable import secrets as launcher_secrets
from tuner.runtime import collecting

SETTINGS = settings(max_examples=200, deadline=None)
secret_values = st.text(string.ascii_letters + string.digits + "-_.~+/=:@!$", min_size=8, max_size=24).filter(
    lambda v: not v.startswith("-") and secrets.MASK not in v)


def test_one_module_one_mask_one_digest() -> None:
    assert secrets.Redactor is launcher_secrets.Redactor and secrets.MASK == "***"
    assert secrets.digest is argvs.sha256
    assert not hasattr(argvs, "redact") and not hasattr(argvs, "REDACTED")  # no second masking


@st.composite
def command_lines(draw: st.DrawFn) -> tuple[list[str], list[str]]:
    argv = ["vllm", "serve", "m", "--max-num-seqs", "8"]
    hidden: list[str] = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["api-key", "watermark", "hf-token", "named", "admin"]))
        if kind == "api-key":
            keys = draw(st.lists(secret_values, min_size=1, max_size=3))
            argv += ["--api-key", *keys]
            hidden += keys
            continue
        if kind == "watermark":
            flag, value = "--watermark-config", json.dumps({"key": draw(secret_values)})
        elif kind == "hf-token":
            flag, value = "--hf-token", draw(secret_values)
        elif kind == "admin":
            flag, value = "--admin-api-key", draw(secret_values)
        else:
            flag, value = draw(st.sampled_from(["--db-password", "--x-secret", "--upstream-token"])), draw(secret_values)
        argv += [f"{flag}={value}"] if draw(st.booleans()) else [flag, value]
        hidden.append(value)
        argv += ["--port", "8000"]
    return argv, hidden


def _forms(value: str) -> list[str]:
    raw = value.encode()
    return [value, urllib.parse.quote(value, safe=""), json.dumps(value)[1:-1], base64.b64encode(raw).decode(),
            base64.urlsafe_b64encode(raw).decode().rstrip("=")]


@SETTINGS
@given(case=command_lines())
def test_every_secret_value_is_masked_in_the_command_line(case: tuple[list[str], list[str]]) -> None:
    argv, hidden = case
    shown = secrets.DEFAULT.argv(argv)  # the launcher's log, status.json, the pool's ConfigMap; the tuner's
    assert len(shown) == len(argv)
    for value in hidden:
        assert all(value not in token for token in shown), (value, shown)
    assert secrets.DEFAULT.restore(shown, argv) == argv  # and every one can be put back from the config


@SETTINGS
@given(case=command_lines(), form=st.integers(0, 4), around=st.text(string.printable, max_size=30))
def test_a_secret_in_free_text_is_masked_in_every_encoding(case: tuple[list[str], list[str]], form: int,
                                                          around: str) -> None:
    argv, hidden = case
    redactor = secrets.DEFAULT.learn(argvs=[argv])  # what the launcher's log scrubbing and the tuner use
    for value in hidden:
        line = f"{around} {_forms(value)[form]} {around}"
        assert _forms(value)[form] not in redactor.text(line)


@SETTINGS
@given(user=st.text(string.ascii_letters, min_size=3, max_size=10), password=secret_values)
def test_a_basic_header_echoed_back_is_masked(user: str, password: str) -> None:
    url = f"http://{user}:{urllib.parse.quote(password, safe='')}@engine:8000/metrics"
    redactor = secrets.DEFAULT.learn(urls=[url])
    echoed = base64.b64encode(f"{user}:{urllib.parse.quote(password, safe='')}".encode()).decode()
    assert echoed not in redactor.text(f"upstream said: Authorization: Basic {echoed}")


@SETTINGS
@given(secret=secret_values, junk=st.text(max_size=40))
def test_a_body_is_described_never_quoted(secret: str, junk: str) -> None:
    body = f"{junk}\nAuthorization: Basic {secret}\n{{not metrics\n"
    snap = snapshots.parse(body, 0.0, source="http://engine/metrics")
    assert snap.error is not None and secret not in snap.error


@SETTINGS
@given(lines=st.lists(secret_values, min_size=2, max_size=4), sep=st.sampled_from(["\n", "\r\n", " ", "\t", "\x00"]))
@example(lines=["scrape.bearer_token_file", "abcdefgh"], sep="\n")
def test_a_token_file_that_is_not_one_token_is_refused_without_showing_it(tmp_path_factory: pytest.TempPathFactory,
                                                                          lines: list[str], sep: str) -> None:
    path = tmp_path_factory.mktemp("token") / "token"

    def refusal(content: list[str]) -> str:
        path.write_text(sep.join(content) + "\n")
        with pytest.raises(ConfigError) as caught:
            collecting.http_settings(config.ScrapeSettings(bearer_token_file=str(path)))
        return str(caught.value)

    # the message shows the file's shape only: the same for any lines of the same lengths, so a line can be in
    # it only as a word of the message's own text. ("No line in the message" failed on such a word: Hypothesis
    # draws the code's constants, and drew "scrape.bearer_token_file", the setting the message names.)
    message = refusal(lines)
    masked = refusal(["x" * len(line) for line in lines])
    assert message == masked
    assert all(line not in message for line in lines if line not in masked)


def test_a_token_file_of_one_line_is_read_and_a_secret_mount_link_followed(tmp_path: Path) -> None:
    (tmp_path / "..data").mkdir()
    (tmp_path / "..data" / "token").write_text("  abc.DEF-123_~+/=\n\n")
    (tmp_path / "token").symlink_to(tmp_path / "..data" / "token")
    settings_ = collecting.http_settings(config.ScrapeSettings(bearer_token_file=str(tmp_path / "token")))
    assert settings_.bearer_token == "abc.DEF-123_~+/="
