"""The engine's whole command line, read from its container (``engine_command``) for adoption: a list as
written, a shell's ``-c`` script that is one simple command as its ``shlex`` split, args only after an
ENTRYPOINT that is known (``KNOWN_ENTRYPOINTS``) or given; and the image references it judges."""

from __future__ import annotations

import dataclasses
import json
import math
import posixpath
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tuner.kube.adoption import AdoptionError, Settings

SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh", "ksh", "busybox"})

# Images whose ENTRYPOINT is known, so a container that gives its command line in args only can be
# adopted: (repository, lowest version, highest version or None) → the ENTRYPOINT. vLLM's own
# docker/Dockerfile (target vllm-openai) ends in ENTRYPOINT ["python3", "-m",
# "vllm.entrypoints.openai.api_server"] in the v0.9 line (commit 0000977e) and in ENTRYPOINT ["vllm",
# "serve"] at commit dead20ba (about October 2025, the v0.11 line), so in every release from v0.12 on;
# v0.10 and v0.11 are not guessed (docs/kubernetes.md, "Args only, and the image's ENTRYPOINT").
VLLM_REPOSITORIES = frozenset({"vllm/vllm-openai", "docker.io/vllm/vllm-openai", "index.docker.io/vllm/vllm-openai"})
KNOWN_ENTRYPOINTS: tuple[tuple[frozenset[str], tuple[int, int], tuple[int, int] | None, tuple[str, ...]], ...] = (
    (VLLM_REPOSITORIES, (0, 0), (0, 9), ("python3", "-m", "vllm.entrypoints.openai.api_server")),
    (VLLM_REPOSITORIES, (0, 12), None, ("vllm", "serve")),
)

# An image reference (the distribution/reference grammar, simplified): [domain[:port]/]path[:tag][@digest].
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"  # a domain's (a registry has a dot, a port or is localhost)
IMAGE_REFERENCE = re.compile(
    rf"^(?P<name>(?:(?P<domain>localhost(?::[0-9]+)?|{_LABEL}(?:\.{_LABEL})+(?::[0-9]+)?|{_LABEL}:[0-9]+)/)?"
    rf"{_COMPONENT}(?:/{_COMPONENT})*)(?::(?P<tag>[\w][\w.-]{{0,127}}))?"
    rf"(?:@(?P<digest>sha256:[0-9a-f]{{64}}))?$")


def image_problem(image: Any) -> str | None:
    """Why ``image`` is not an image reference (None: it is one)."""
    if not isinstance(image, str) or not image:
        return "no image"
    if len(image) > 4096 or not IMAGE_REFERENCE.match(image):
        return f"{image[:200]!r} is not an image reference ([REGISTRY/]REPOSITORY[:TAG][@sha256:DIGEST], lower-case)"
    return None


def image_warning(image: str) -> str | None:
    """Why ``image`` is not pinned (None: a version tag or a digest)."""
    m = IMAGE_REFERENCE.match(image)
    if m is None or m.group("digest"):
        return None
    if m.group("tag") is None:
        return f"image {image} has no tag (it means :latest): pods started on different days may run different images"
    if m.group("tag") == "latest":
        return f"image {image} is :latest: pods started on different days may run different images"
    return None


def known_entrypoint(image: Any) -> tuple[str, ...] | None:
    m = IMAGE_REFERENCE.match(image) if isinstance(image, str) else None
    if m is None or m.group("tag") is None:
        return None
    version = re.match(r"^v?(\d+)\.(\d+)(?:\.\d+)?(?:[.-]?post\d+)?$", m.group("tag"))
    if version is None:
        return None
    v = (int(version.group(1)), int(version.group(2)))
    for repositories, lo, hi, entrypoint in KNOWN_ENTRYPOINTS:
        if m.group("name") in repositories and lo <= v and (hi is None or v <= hi):
            return entrypoint
    return None


def _strings(where: str, name: str, key: str, value: Any, problems: list[AdoptionError]) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        problems.append(AdoptionError(where, f"container {name}'s {key} is a string, not a list (Kubernetes "
                                             "refuses it; split into one argument per character it would run "
                                             "nothing)", f"write it as a list, e.g. {key}: {_flow(value.split()[:4])}"))
        return []
    if not isinstance(value, list) or not all(isinstance(a, (str, int, float)) and not isinstance(a, bool)
                                              for a in value):
        problems.append(AdoptionError(where, f"container {name}'s {key} is not a list of strings",
                                      f"write it as a list of strings, e.g. {key}: [vllm, serve, MODEL]"))
        return []
    return [str(a) for a in value]


def _flow(argv: Sequence[str]) -> str:
    """A list as YAML/JSON flow text the user can paste."""
    return json.dumps(list(argv), ensure_ascii=False)


_SIMPLE_OPERATORS = re.compile(r"&&|\|\||[;&|\n]")
_KUBE_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def script_problem(script: str, env: Iterable[str]) -> str | None:
    """Why a ``sh -c`` script is not one simple command (None: it is one). Quotes are fine; operators,
    redirections, expansions, globs, comments, assignments and several lines are not. ``$(VAR)`` of a
    variable in the container's env is the kubelet's own expansion (done before the shell runs), so it
    stays allowed."""
    names = set(env)
    text = _KUBE_VAR.sub(lambda m: "_" if m.group(1) in names else m.group(0), script.replace("\\\n", " "))
    quote = None
    i = 0
    while i < len(text):
        c = text[i]
        if quote == "'":
            quote = None if c == "'" else quote
        elif quote == '"':
            if c in '$`':
                return "it expands variables or commands inside double quotes"
            if c == "\\":
                i += 1
            elif c == '"':
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "\\":
            i += 1
        elif c in ";&|":
            return "it runs more than one command (;, &&, || or |)"
        elif c in "<>":
            return "it redirects input or output"
        elif c in "$`":
            return "it expands variables or commands ($, `)"
        elif c in "()":
            return "it uses a subshell or a function"
        elif c in "*?[{~":
            return "it uses globbing or brace/tilde expansion"
        elif c == "#" and (i == 0 or text[i - 1] in " \t"):
            return "it has a comment"
        elif c == "\n" and text[i + 1:].strip():
            return "it has more than one line"
        i += 1
    if quote:
        return "a quote is not closed"
    try:
        words = shlex.split(text)
    except ValueError:
        return "it cannot be split into words"
    if not words or (words[0] == "exec" and len(words) == 1):
        return "it is empty"
    first = words[1] if words[0] == "exec" else words[0]
    if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", first):
        return "it sets a variable before the command (use the container's env instead)"
    return None


def _suggested_argv(script: str) -> list[str] | None:
    """The engine's own command out of a script that is more than one command: the last command that
    runs vLLM (``vllm …`` or ``python… -m vllm…``), as a list."""
    try:
        lexer = shlex.shlex(script.replace("\\\n", " "), posix=True, punctuation_chars=";&|<>()")
        lexer.whitespace_split = True
        lexer.whitespace = " \t\r"
        tokens = list(lexer)
    except ValueError:
        return None
    commands: list[list[str]] = [[]]
    for token in tokens:
        if token and (set(token) <= set(";&|<>()") or token == "\n"):
            commands.append([])
        else:
            commands[-1].extend(token.split("\n"))
    for words in reversed(commands):
        words = [w for w in words if w]
        while words and (words[0] == "exec" or re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0])):
            words = words[1:]
        if words and (posixpath.basename(words[0]) == "vllm" or any(w.startswith("vllm.") for w in words[:3])):
            return words
    return None


@dataclasses.dataclass(frozen=True)
class Command:
    argv: list[str]
    """The engine's whole command line."""
    command: list[str]
    """What the container's ``command`` runs after the wrapper (``args`` follow it, unless ``drop_args``)."""
    drop_args: bool = False
    note: str | None = None
    """What was rewritten to get it (None: taken as written)."""


def engine_command(where: str, container: Mapping[str, Any], settings: Settings, problems: list[AdoptionError]
                   ) -> Command | None:
    """The engine's whole command line; None (and a problem said) when it cannot be had."""
    name = container.get("name")
    command = _strings(where, str(name), "command", container.get("command"), problems)
    args = _strings(where, str(name), "args", container.get("args"), problems)
    if problems:
        return None
    if not command:
        image = container.get("image")
        entrypoint = settings.entrypoint or known_entrypoint(image)
        if not entrypoint:
            problems.append(AdoptionError(
                where, f"container {name} gives its command line in args only, after the ENTRYPOINT of image "
                       f"{image}, which is not known here (the launcher must run the whole command line)",
                "say the image's ENTRYPOINT with --entrypoint (e.g. --entrypoint vllm,serve for vllm/vllm-openai "
                f"v0.12 and later), or give all of it in command, e.g. command: {_flow(['vllm', 'serve', *args[:3]])}"))
            return None
        how = "--entrypoint" if settings.entrypoint else f"the ENTRYPOINT of {image}"
        return Command([*entrypoint, *args], list(entrypoint),
                       note=f"container {name} gives args only: adopted after {how}, command {_flow(entrypoint)}")
    argv = command + args
    flags = next((i for i, a in enumerate(argv[1:3], 1) if a.startswith("-") and not a.startswith("--")
                  and "c" in a[1:]), None)
    if posixpath.basename(argv[0]) not in SHELLS or flags is None:
        return Command(argv, command)
    if flags + 1 >= len(argv):
        problems.append(AdoptionError(where, f"container {name} runs {argv[0]} -c without a script",
                                      "write the engine's command line as a list, e.g. command: "
                                      "[vllm, serve, MODEL, --port, \"8000\"]"))
        return None
    script, rest = argv[flags + 1], argv[flags + 2:]
    env = [str(e.get("name")) for e in container.get("env") or [] if isinstance(e, Mapping)]
    why = "it is followed by more arguments ($0, $1, … of the script)" if rest else script_problem(script, env)
    if why is None:
        words = shlex.split(_KUBE_VAR.sub(lambda m: m.group(0), script.replace("\\\n", " ")))
        words = words[1:] if words[0] == "exec" else words
        return Command(words, words, drop_args=True,
                       note=f"container {name}'s script {argv[0]} -c {script!r} adopted as its argv: command "
                            f"{_flow(words)}")
    suggested = _suggested_argv(script)
    fix = (f"write the engine's command line as a list: command: {_flow(suggested)} (and args: [] ); anything "
           "else the script did belongs in an init container or the image" if suggested else
           "write the engine's command line as a list, e.g. command: [vllm, serve, MODEL, --port, \"8000\"] (the "
           "kubelet expands $(VAR) in it itself)")
    problems.append(AdoptionError(
        where, f"container {name} runs its engine through a shell script that is not one simple command ({why}): "
               "the tuner's flags would be appended after the script, where the shell ignores them, and every "
               "change would be a no-op", fix))
    return None


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    value = None
    for i, token in enumerate(argv):
        if token == "--":
            break
        if token == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith(flag + "="):
            value = token.split("=", 1)[1]
    return value


def number(where: str, argv: Sequence[str], flag: str, default: float, *, hi: float,
           problems: list[AdoptionError]) -> float:
    text = flag_value(argv, flag)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        problems.append(AdoptionError(where, f"{flag} {text[:80]!r} is not a number of seconds the timeouts can be "
                                             "derived from", f"give it literally, e.g. {flag} 30"))
        return default
    if not math.isfinite(value) or not 0 <= value <= hi:
        problems.append(AdoptionError(where, f"{flag} {text[:80]!r} is out of range", f"give a number from 0 to "
                                                                                       f"{hi:g}, e.g. {flag} 30"))
        return default
    return value
