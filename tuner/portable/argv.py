"""The engine's command line, read and patched by flag: the one reader and the one writer of command lines.

Stdlib only (the in-pod launcher runs it under the engine image's Python); ``tuner.model.engine_args.EngineArgs``
reads and writes through it too. An override replaces the flag's value in place, keeping its spelling and
form (``--flag v`` or ``--flag=v``), or is appended when the flag is absent; ``True``/``False`` on a boolean
flag writes ``--flag``/``--no-flag``; ``None`` removes the flag. Nothing here ever goes through a shell.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Literal, NamedTuple

Value = str | bool | None

# vLLM's flags that take no value — the one table, for the tuner and the launcher: a bare boolean flag
# followed by a non-flag token is a flag and a positional, not a flag and its value.
BOOLEAN_FLAGS: frozenset[str] = frozenset({
    "--enable-chunked-prefill", "--enable-prefix-caching", "--enforce-eager", "--trust-remote-code",
    "--allow-credentials", "--disable-log-stats", "--disable-log-requests", "--enable-log-requests", "--enable-sleep-mode",
    "--async-scheduling", "--enable-lora", "--enable-prompt-tokens-details",
    "--enable-server-load-tracking", "--disable-custom-all-reduce", "--enable-expert-parallel",
    "--disable-frontend-multiprocessing", "--enable-auto-tool-choice", "--disable-fastapi-docs",
    "--skip-tokenizer-init", "--disable-sliding-window", "--disable-cascade-attn",
    "--enable-metrics", "--disable-radix-cache", "--enable-mixed-chunk", "--enable-torch-compile",
    "--disable-cuda-graph", "--enable-dp-attention", "--collect-tokens-histogram",
})

FLAG_NAME = re.compile(r"^--[A-Za-z0-9][A-Za-z0-9_-]*$")


Form = Literal["space", "equals", "bare", "positional"]


class Item(NamedTuple):
    """One argv item: a positional, ``--flag``, ``--flag value`` or ``--flag=value``."""

    flag: str | None  # as written; None for a positional
    value: str | None
    form: Form

    @property
    def key(self) -> str | None:
        return normalize(self.flag) if self.flag is not None else None

    def tokens(self) -> list[str]:
        if self.form == "positional":
            return [self.value or ""]
        assert self.flag is not None
        if self.form == "bare":
            return [self.flag]
        if self.form == "equals":
            return [f"{self.flag}={self.value}"]
        return [self.flag, self.value or ""]


_NORMALIZED: dict[str, str] = {}  # flag as written → its spelling; a few dozen flags, read every cycle


def normalize(flag: str) -> str:
    """``--max_num_seqs`` → ``--max-num-seqs`` (vLLM's parser accepts both spellings)."""
    known = _NORMALIZED.get(flag)
    if known is not None:
        return known
    out = "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag
    if len(_NORMALIZED) < 4096:  # bounded: argv comes from configuration, but a bound costs nothing
        _NORMALIZED[flag] = out
    return out


def is_flag_token(token: str) -> bool:
    """An option, not a value: ``--x``, ``-x`` (``-tp 2``, ``-O3``); not ``-1`` or ``-0.5`` (argparse's view)."""
    if token.startswith("--") and len(token) > 2:
        return True
    return token.startswith("-") and len(token) > 1 and not re.match(r"^-\.?\d", token)


def is_boolean(key: str) -> bool:
    """A flag that takes no value (``--no-`` forms of them too)."""
    return key in BOOLEAN_FLAGS or (key.startswith("--no-") and "--" + key[5:] in BOOLEAN_FLAGS)


def parse(argv: Sequence[str]) -> list[Item]:
    items: list[Item] = []
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--":  # everything after is positional
            items.extend(Item(None, t, "positional") for t in tokens[i:])
            break
        if not is_flag_token(token):
            items.append(Item(None, token, "positional"))
            i += 1
        elif token.startswith("--") and "=" in token:
            flag, _, value = token.partition("=")
            items.append(Item(flag, value, "equals"))
            i += 1
        else:
            nxt = tokens[i + 1] if i + 1 < len(tokens) else None
            if nxt is None or is_flag_token(nxt) or is_boolean(normalize(token)):
                items.append(Item(token, None, "bare"))
                i += 1
            else:
                items.append(Item(token, nxt, "space"))
                i += 2
    return items


def render(items: Sequence[Item]) -> list[str]:
    return [t for item in items for t in item.tokens()]


def _same(item: Item, key: str) -> bool:
    return item.key is not None and (item.key == key or item.key == "--no-" + key[2:])


def find(items: Sequence[Item], flag: str) -> int | None:
    """The index of the last item for ``flag`` (argparse: the last one wins), ``--no-`` forms and either
    spelling included; None when absent."""
    key = normalize(flag)
    found = None
    for i, item in enumerate(items):
        if _same(item, key):
            found = i
    return found


def _text(value: str | bool) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


def with_value(items: Sequence[Item], flag: str, value: Value) -> list[Item]:
    key = normalize(flag)
    if value is None:
        return [it for it in items if not _same(it, key)]
    boolean = isinstance(value, bool) and (is_boolean(key) or key.startswith("--enable-"))
    new = Item(key if value else "--no-" + key[2:], None, "bare") if boolean else Item(key, _text(value), "space")
    out = list(items)
    at = find(out, key)
    if at is None:
        return [*out, new]
    old = out[at]
    if not boolean and old.form in ("equals", "space"):
        new = Item(old.flag, new.value, old.form)
    out[at] = new
    return [it for i, it in enumerate(out) if i == at or not _same(it, key)]  # earlier duplicates go


def apply(base: Sequence[str], overrides: Sequence[tuple[str, Value]]) -> list[str]:
    """``base`` with each override applied in order."""
    items = parse(base)
    for flag, value in overrides:
        items = with_value(items, flag, value)
    return render(items)


def value_of(argv: Sequence[str], flag: str) -> str | None:
    """The text value of ``flag`` in ``argv`` (the last one), or None (absent or bare)."""
    items = parse(argv)
    at = find(items, flag)
    return None if at is None else items[at].value


def sha256(argv: Sequence[str]) -> str:
    """The identity of a base command line: sha256 of its canonical JSON (a list of strings, compact
    separators, UTF-8). The agent computes the same from the pod spec (or copies it from status.json)."""
    text = json.dumps(list(argv), separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
