"""Secrets: which engine arguments and environment variables carry credentials, and how they are
masked wherever the tuner or the launcher shows or stores them. Pure: no I/O; standard library only,
so that the launcher (``tuner.launcher``, under the engine image's Python) and the tuner
(``tuner.model.secrets`` names this module) mask with the one list, the one mask and the one digest.

The engine must receive its secrets (``--api-key`` in ``targets[].args``, ``HF_TOKEN`` in
``actuator.env``); nothing the tuner *shows* (logs, ``/metrics``, ``/status``, ``/recommendations``,
``check-config``) or *stores for itself* (journal, ``state.json``, pid files) may carry them. Masking
keeps the shape of a command line — ``--api-key ***``, ``--api-key=***`` — so it still reads as one,
and every masked value can be put back from the configuration (``restore``): the tuner never changes
a secret flag, so the value in ``targets[].args`` is the one every command line it builds carries.

Three ways a secret is recognised:

- **by position**: the value(s) after a secret flag (``FLAGS``; vLLM 0.32's ``--api-key`` takes one or
  more keys, ``--hf-token`` at most one; any other flag named like one, ``--db-password``,
  ``--x-secret``: ``FLAG_NAME``, one value) and the value of a secret environment variable (``ENV_NAMES``,
  or a name with a word such as ``TOKEN``, ``SECRET``, ``PASSWORD`` or ``KEY``: ``is_secret_env``);
- **by value**: every secret the configuration holds (``Redactor.values``: the flags' values, the
  variables' values, the bearer token, a password in a URL) is searched for in free text — reasons,
  log lines, details — and replaced, in every encoding it can take there (``encodings``: as written,
  percent-encoded, JSON-escaped, base64 — and ``user:password`` base64 as in a Basic header) (values shorter than ``MIN_TEXT_LENGTH`` are masked by position
  only: searching for them would mangle unrelated text);
- **by pattern** in free text: ``--api-key VALUE``, ``HF_TOKEN=VALUE``, ``Bearer VALUE``.

``daemon.secret_flags`` and ``daemon.secret_env`` add flags and variable names (``Redactor.extended``).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import argv as syntax

MASK = "***"  # what vLLM's own log shows for a redacted argument
MIN_TEXT_LENGTH = 6

FLAGS: Mapping[str, str] = {
    # flag → how many values follow it: "+" every token up to the next flag, "?" at most one, "1" one.
    "--api-key": "+",  # vLLM (nargs="+": one or more keys guarding /v1/*) and SGLang
    "--hf-token": "?",  # vLLM: bearer token for Hugging Face downloads (alone: the stored login)
    "--watermark-config": "1",  # vLLM: JSON holding the watermark's secret key (vLLM masks it in its log)
    "--admin-api-key": "1",  # SGLang: the admin endpoints' key
}
"""The engines' flags whose values are credentials (vLLM 0.32's parser, SGLang's server arguments)."""

def _is_switch(name: str) -> bool:
    bare = name[5:] if name.startswith("--no-") else name[2:]
    return f"--{bare}" in syntax.BOOLEAN_FLAGS or f"--{bare}".replace("_", "-") in syntax.BOOLEAN_FLAGS


FLAG_NAME = re.compile(r"(?:^--|[-_])(?:key|token|secret|password|passwd|credentials?)$", re.IGNORECASE)
"""Any other flag named like a credential (``--db-password``, ``--x-secret``; not ``--ssl-keyfile`` nor
``--max-num-batched-tokens``): one value, masked."""

ENV_NAMES: frozenset[str] = frozenset({
    "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "VLLM_API_KEY", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN", "AZURE_CLIENT_SECRET", "WANDB_API_KEY", "NGC_API_KEY", "MODELSCOPE_API_TOKEN",
})
"""Environment variables known to hold credentials; any name with a word of ``ENV_WORDS`` is one too."""

ENV_WORDS: frozenset[str] = frozenset({
    "TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "APIKEY", "CREDENTIAL", "CREDENTIALS", "PRIVATE",
})
"""Words (between underscores) that make a variable's value secret: conservative on purpose — a
masked ``SSH_KEY_PATH`` costs nothing, a shown ``MY_SERVICE_SECRET`` does. ``TOKENIZERS_PARALLELISM``
has no such word."""

_URL_SECRET_PARAMS = re.compile(r"(?i)token|key|secret|password|passwd|sig|auth")
_NOT_MASKED = r"(?!\*\*\*)"
_BEARER = re.compile(rf"(?i)(\bbearer\s+){_NOT_MASKED}[A-Za-z0-9._~+/=-]+")
# Free text that names a credential by key: "api_key": "…", 'hf_token': ['…'], password: "…" (quoted values)
_KEYS = r"api[-_]?keys?|admin[-_]?api[-_]?key|hf[-_]?token|access[-_]?token|auth[-_]?token|token|password|passwd|secret"
_KEY_WORDS = ("key", "token", "passw", "secret")
_KEY_VALUE = re.compile(rf"""(?i)(["']?\b(?:{_KEYS})["']?\s*[:=]\s*\[?\s*(["'])){_NOT_MASKED}[^"']*(?=\2)""")
_KEY_ASSIGN = re.compile(rf"(?i)(\b(?:{_KEYS})=){_NOT_MASKED}[^\s&'\",;]+")  # token=…, ?api_key=…
_ENV_ASSIGN = re.compile(rf"(\b([A-Z_][A-Z0-9_]*)=){_NOT_MASKED}[^\s'\",;]+")  # HF_TOKEN=…


# the launcher's reader of command lines (stdlib only): one for the tuner and the pod
normalize_flag = syntax.normalize
_is_flag_token = syntax.is_flag_token


digest = syntax.sha256
"""sha256 of a command line's canonical JSON (hex): recognises the same command without storing it —
the launcher's base identity and the tuner's pid files and state, one digest."""


def digest_matches(argv: Sequence[str], recorded: object) -> bool:
    """Whether ``recorded`` (from a pid or state file) is this command line's ``digest`` — or the one the
    tuner wrote before there was one digest (json.dumps' default separators), so that an upgrade keeps
    adopting its engines and its saved state."""
    if not isinstance(recorded, str):
        return False
    earlier = hashlib.sha256(json.dumps(list(argv), ensure_ascii=False).encode("utf-8")).hexdigest()
    return recorded in (digest(argv), earlier)


def _percent(raw: bytes) -> str:
    """RFC 3986 percent-encoding of every byte but the unreserved ones (``urllib.parse.quote(safe="")``;
    the pure core imports no ``urllib``)."""
    unreserved = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~"
    return "".join(chr(b) if b in unreserved else f"%{b:02X}" for b in raw)


def encodings(value: str) -> set[str]:
    """The forms a secret takes in text: as written, percent-encoded (a URL, a form), JSON-escaped (a
    quoted document), base64 (standard and URL-safe, padded or not: a Basic header, a token echoed)."""
    raw = value.encode("utf-8", "surrogateescape")
    forms = {value, _percent(raw), _percent(raw).replace("%20", "+"),
             json.dumps(value, ensure_ascii=True)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1]}
    for b64 in (base64.b64encode(raw), base64.urlsafe_b64encode(raw)):
        text = b64.decode("ascii")
        forms |= {text, text.rstrip("=")}
    return {f for f in forms if f}


@dataclass(frozen=True)
class Redactor:
    """What counts as secret, and the masking itself. ``DEFAULT`` knows the flags and names but no
    values; ``learn`` and ``extended`` add what a configuration holds."""

    flags: Mapping[str, str] = field(default_factory=lambda: dict(FLAGS))
    env_names: frozenset[str] = ENV_NAMES
    values: frozenset[str] = frozenset()

    # -- building ---------------------------------------------------------------------------------
    def extended(self, *, flags: Iterable[str] = (), env: Iterable[str] = (), values: Iterable[str] = ()
                 ) -> Redactor:
        """More secret flags (taking one value each unless known), variable names and values."""
        more = {normalize_flag(f): self.flags.get(normalize_flag(f), "1") for f in flags}
        found = {form for v in values if v and v != MASK for form in encodings(v)}
        return Redactor(flags={**self.flags, **more}, env_names=self.env_names | {e.upper() for e in env},
                        values=self.values | found)

    def learn(self, *, argvs: Iterable[Sequence[str]] = (), env: Mapping[str, str] | None = None,
              urls: Iterable[str] = (), values: Iterable[str] = ()) -> Redactor:
        """This redactor, also searching free text for the secrets these hold."""
        found = [v for argv in argvs for v in self.secret_values(argv)]
        found += [v for k, v in (env or {}).items() if self.is_secret_env(k)]
        found += [v for url in urls for v in url_secrets(url)]
        # user:password as a Basic header carries it (base64: ``encodings``), echoed back by a proxy
        found += [f"{m.group(1)}:{m.group(2)}" for url in urls for m in _URL_USERINFO.finditer(url) if m.group(2)]
        return self.extended(values=[*found, *values])

    # -- recognising ------------------------------------------------------------------------------
    def is_secret_flag(self, token: str) -> bool:
        name = normalize_flag(token.partition("=")[0])
        if name in self.flags:
            return True
        # named like a credential, and takes a value: vLLM's --allow-credentials is a switch (CORS)
        return name.startswith("--") and bool(FLAG_NAME.search(name)) and not _is_switch(name)

    def arity(self, flag: str) -> str:
        return self.flags.get(normalize_flag(flag), "1")

    def is_secret_env(self, name: str) -> bool:
        upper = name.upper()
        return upper in self.env_names or bool(ENV_WORDS.intersection(upper.split("_")))

    def _walk(self, argv: Sequence[str]) -> list[tuple[int, str | None]]:
        """(index, flag) of every secret value in ``argv``; ``flag`` None for an ``--flag=value`` token."""
        out: list[tuple[int, str | None]] = []
        i, n = 0, len(argv)
        while i < n:
            token = argv[i]
            if token == "--":
                break
            if token.startswith("--") and "=" in token:
                if self.is_secret_flag(token):
                    out.append((i, None))
                i += 1
                continue
            if self.is_secret_flag(token):
                arity = self.arity(token)
                i += 1
                taken = 0
                while i < n and not _is_flag_token(argv[i]) and argv[i] != "--" and (arity == "+" or taken < 1):
                    out.append((i, normalize_flag(token)))
                    i += 1
                    taken += 1
                continue
            i += 1
        return out

    def secret_values(self, argv: Sequence[str]) -> list[str]:
        """The secret values in a command line, in order."""
        return [argv[i].partition("=")[2] if flag is None else argv[i] for i, flag in self._walk(argv)]

    @functools.cached_property
    def _flag_patterns(self) -> tuple[re.Pattern[str], ...]:
        """``--api-key VALUE``, ``--api-key=VALUE`` and a list's ``'--api-key', 'VALUE'`` in free text."""
        if not self.flags:
            return ()
        names = "|".join(re.escape(f[2:]).replace("\\-", "[-_]") for f in sorted(self.flags, key=len, reverse=True))
        names += r"|[A-Za-z0-9_-]*[-_](?:key|token|secret|password|passwd|credentials?)"  # FLAG_NAME's
        return (re.compile(rf"(--(?:{names})(?:=|\s+)){_NOT_MASKED}[^\s'\",\]]+"),
                re.compile(rf"""((["'])--(?:{names})\2\s*,\s*(["'])){_NOT_MASKED}[^"']*(?=\3)"""))

    # -- masking ----------------------------------------------------------------------------------
    def argv(self, argv: Sequence[str]) -> list[str]:
        """The command line with every secret value masked, same length and shape."""
        out = list(argv)
        for i, flag in self._walk(argv):
            out[i] = f"{argv[i].partition('=')[0]}={MASK}" if flag is None else MASK
        return out

    def env(self, env: Mapping[str, str]) -> dict[str, str]:
        return {k: (MASK if self.is_secret_env(k) else v) for k, v in env.items()}

    def text(self, text: str) -> str:
        """Free text with every known secret value and every recognisable secret pattern masked."""
        for value in sorted((v for v in self.values if len(v) >= MIN_TEXT_LENGTH), key=len, reverse=True):
            if value in text:
                text = text.replace(value, MASK)
        if "--" in text:
            for pattern in self._flag_patterns:
                text = pattern.sub(rf"\1{MASK}", text)
        lower = text.lower()  # the patterns below are costly: run each only where it can match
        if "bearer" in lower:
            text = _BEARER.sub(rf"\1{MASK}", text)
        if any(word in lower for word in _KEY_WORDS):
            text = _KEY_VALUE.sub(rf"\1{MASK}", text)
            text = _KEY_ASSIGN.sub(rf"\1{MASK}", text)
        if "=" in text:

            def env_value(m: re.Match[str]) -> str:
                return f"{m.group(1)}{MASK}" if self.is_secret_env(m.group(2)) else m.group(0)

            text = _ENV_ASSIGN.sub(env_value, text)
        return text

    def data(self, value: Any) -> Any:
        """A JSON-like document (dicts, lists, strings) with every secret masked: lists that hold a
        secret flag as command lines, a secret flag's or variable's entry in a mapping, any string as
        free text."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {k: (MASK if isinstance(k, str) and (self.is_secret_flag(k) or self.is_secret_env(k))
                        and isinstance(v, str | int | float) and not isinstance(v, bool) else self.data(v))
                    for k, v in value.items()}
        if isinstance(value, list | tuple):
            if value and all(isinstance(v, str) for v in value) and any(self.is_secret_flag(v) for v in value):
                value = self.argv(value)
            return [self.data(v) for v in value]
        return value

    # -- fingerprints: (key, value) pairs of a command line (``EngineArgs.fingerprint``) ---------
    def pairs(self, pairs: Iterable[Sequence[str]]) -> list[list[str]]:
        """Mask the value of a secret flag's pair, and a positional pair holding a known secret (the
        second key of ``--api-key k1 k2``)."""
        return [[k, MASK if (k and self.is_secret_flag(k)) or (not k and v in self.values) else v]
                for k, v in pairs]

    def restore_pairs(self, pairs: Iterable[Sequence[str]], reference: Iterable[Sequence[str]]) -> list[list[str]]:
        """Masked pairs back to the reference's real ones (the configuration's command line: the
        tuner never changes a secret flag, so its pairs are the ones every masked pair stood for)."""
        spare: dict[tuple[str, str], list[list[str]]] = {}
        for real in reference:
            masked = self.pairs([real])[0]
            if masked != list(real):
                spare.setdefault((masked[0], masked[1]), []).append([str(real[0]), str(real[1])])
        out = []
        for k, v in pairs:
            left = spare.get((k, v))
            out.append(left.pop(0) if left else [k, v])
        return out

    # -- putting secrets back -----------------------------------------------------------------------
    def restore(self, masked: Sequence[str], reference: Sequence[str]) -> list[str]:
        """``masked`` with each masked secret value taken, in order, from ``reference`` (the
        configuration's ``targets[].args``). ValueError if ``reference`` lacks one."""
        values: dict[str, list[str]] = {}
        for i, flag in self._walk(reference):
            key = normalize_flag(reference[i].partition("=")[0]) if flag is None else flag
            values.setdefault(key, []).append(reference[i].partition("=")[2] if flag is None else reference[i])
        out = list(masked)
        for i, flag in self._walk(masked):
            token = masked[i]
            key = normalize_flag(token.partition("=")[0]) if flag is None else flag
            current = token.partition("=")[2] if flag is None else token
            if current != MASK:
                continue
            left = values.get(key)
            if not left:
                raise ValueError(f"{key}: masked, and the configured arguments hold no value to put back")
            real = left.pop(0)
            out[i] = f"{token.partition('=')[0]}={real}" if flag is None else real
        return out


_URL_PASSWORD = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/?#@:]*:([^/?#@]*)@")
_URL_USERINFO = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://([^/?#@:]*):([^/?#@]*)@")
_URL_PARAM = re.compile(r"[?&]([^=&#]+)=([^&#]*)")


def url_secrets(url: str) -> list[str]:
    """The password of ``scheme://user:password@host`` and the values of query parameters named like
    a credential (``?token=…``, ``&api_key=…``), as written in the URL."""
    found = [m.group(1) for m in _URL_PASSWORD.finditer(url) if m.group(1)]
    found += [v for k, v in _URL_PARAM.findall(url.partition("#")[0]) if v and _URL_SECRET_PARAMS.search(k)]
    return found


DEFAULT = Redactor()
