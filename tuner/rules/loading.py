"""Loading rule files: YAML → validated ``RuleSet``, or a ``ConfigError`` naming file, rule and field.

Errors read like::

    rules/mine.yaml: 2 problem(s)
      - rules[1] (id: queue-up).when.all[0].signal: unknown signal 'queue_ms'; similar: queue_time_mean_s, ...
      - rules[2] (id: Bad_Id).id: String should match pattern '^[a-z][a-z0-9-]*$'; got 'Bad_Id'
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tuner.errors import ConfigError
from tuner.portable import untrusted
from tuner.rules.schema import Rule, RuleFile

_TAGS = frozenset({"compare", "all", "any"})


@dataclass(frozen=True, slots=True)
class RuleSet:
    """Validated rules from one or more files, in load order; ``origin`` maps rule id → file."""

    rules: tuple[Rule, ...] = ()
    origin: tuple[tuple[str, str], ...] = ()

    def __iter__(self) -> Iterator[Rule]:
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def get(self, rule_id: str) -> Rule | None:
        for rule in self.rules:
            if rule.id == rule_id:
                return rule
        return None

    def file_of(self, rule_id: str) -> str | None:
        return dict(self.origin).get(rule_id)

    @property
    def enabled(self) -> tuple[Rule, ...]:
        return tuple(r for r in self.rules if r.enabled)


def _where(loc: Sequence[Any], data: Any) -> str:
    """``('rules', 2, 'when', 'all', 0, 'compare', 'signal')`` → ``rules[2] (id: x).when.all[0].signal``."""
    parts: list[Any] = []
    previous_was_index = False
    for part in loc:
        # A discriminated union puts its tag right after the list index; it is not a field name.
        if previous_was_index and part in _TAGS and isinstance(part, str):
            previous_was_index = False
            continue
        parts.append(part)
        previous_was_index = isinstance(part, int)
    out = ""
    for i, part in enumerate(parts):
        if isinstance(part, int):
            out += f"[{part}]"
            if i == 1 and parts[0] == "rules":
                rule_id = _rule_id(data, part)
                if rule_id:
                    out += f" (id: {rule_id})"
        else:
            out += f".{part}" if out else str(part)
    return out


def _rule_id(data: Any, index: int) -> str | None:
    try:
        value = data["rules"][index]["id"]
    except (KeyError, IndexError, TypeError):
        return None
    return str(value) if value is not None else None


def _what(err: Any) -> str:
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        return "unknown field (see docs/rules.md for the rule format)"
    if err["type"] == "missing":
        return "required field is missing"
    if "input" in err and err["type"] not in ("model_type", "value_error", "condition"):
        given = repr(err["input"])
        return f"{msg}; got {given[:80]}"
    return msg


def parse(data: Any, *, file: str = "<rules>") -> RuleSet:
    """Validate already-parsed YAML. A bare list of rules is accepted as ``{rules: [...]}``."""
    if isinstance(data, list):
        data = {"rules": data}
    if data is None:
        raise ConfigError(file, [("", "the file is empty; expected `rules:` with a list of rules")])
    if not isinstance(data, dict):
        what = f"expected a mapping with `rules:` at the top level, got {type(data).__name__}"
        raise ConfigError(file, [("", what)])
    try:
        parsed = RuleFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(file, [(_where(e["loc"], data), _what(e)) for e in exc.errors()]) from exc
    return RuleSet(tuple(parsed.rules), tuple((r.id, file) for r in parsed.rules))


YAML_MAX_BYTES = 1024 * 1024
YAML_MAX_NODES = 100_000
YAML_MAX_DEPTH = 64


def read_yaml(path: str | Path, *, what: str) -> Any:
    """A YAML file's data; ConfigError naming the file (and line) when it cannot be read or parsed.
    Shared by rule files and the tuner's configuration (``check-config`` and ``run`` alike).

    Bounded: at most ``YAML_MAX_BYTES``, read without blocking (``untrusted``: a FIFO is refused; a
    ConfigMap's files are links, followed); the document's size *with every alias expanded* is counted
    on the composed node graph — where an alias is one shared node, so counting costs what the text
    costs — and more than ``YAML_MAX_NODES`` (a "billion laughs" of a few hundred bytes), more than
    ``YAML_MAX_DEPTH`` levels or an alias inside itself is refused before anything is constructed."""
    path = Path(path)
    try:
        raw = untrusted.read_bytes(path, max_bytes=YAML_MAX_BYTES, follow_symlinks=True)
        text = raw.decode("utf-8")
    except (OSError, untrusted.Untrusted, UnicodeDecodeError) as exc:
        why = (exc.reason if isinstance(exc, untrusted.Untrusted) else
               getattr(exc, "strerror", None) or f"{type(exc).__name__}")
        raise ConfigError(str(path), [("", f"cannot read the {what}: {why}")]) from None
    docs = parse_yaml(text, what=str(path), single=True)
    return docs[0] if docs else None


def parse_yaml(text: str, *, what: str, single: bool = False) -> list[Any]:
    """The documents of a YAML text (``---``-separated; empty ones left out), through the same bounds
    as ``read_yaml``: every document's expansion with its aliases is counted on the node graph before
    anything is constructed, and the whole stream together may not exceed ``YAML_MAX_NODES``. Shared by
    the configuration, rule files and ``vllm-tuner inject`` (a Helm post-renderer: a manifest that
    hangs it stalls the install). ``single``: a second document is an error. ``ConfigError`` naming
    ``what`` (and the line) otherwise."""
    if len(text) > YAML_MAX_BYTES:
        raise ConfigError(what, [("", f"{len(text)} characters; the limit is {YAML_MAX_BYTES}")])
    loader = None
    try:
        loader = yaml.SafeLoader(text)  # its reader refuses a non-printable character already
        nodes: list[yaml.Node] = []
        budget = YAML_MAX_NODES
        if single:
            node = loader.get_single_node()
            nodes = [node] if node is not None else []
        else:
            while loader.check_node():
                node = loader.get_node()
                if node is not None:
                    nodes.append(node)
        for node in nodes:
            budget -= _check_expansion(node, budget)
        return [d for d in (loader.construct_document(n) for n in nodes) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(what, [(where, f"not valid YAML: {getattr(exc, 'problem', exc)}")]) from None
    except _TooLarge as exc:
        raise ConfigError(what, [(exc.where, str(exc))]) from None
    except RecursionError:
        raise ConfigError(what, [("", f"nested deeper than {YAML_MAX_DEPTH} levels")]) from None
    finally:
        if loader is not None:
            loader.dispose()


class _TooLarge(ValueError):
    def __init__(self, message: str, node: yaml.Node) -> None:
        super().__init__(message)
        self.where = f"line {node.start_mark.line + 1}, column {node.start_mark.column + 1}"


def _check_expansion(root: yaml.Node, limit: int = YAML_MAX_NODES) -> int:
    """The document's size, aliases expanded; ``_TooLarge`` when it would exceed ``limit`` values or
    the depth bound."""
    sizes: dict[int, int] = {}  # node id → expanded size (a shared node is counted once per use, computed once)
    active: set[int] = set()

    def size(node: yaml.Node, depth: int) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise _TooLarge("an alias refers to the node that holds it (a recursive document)", node)
        if depth > YAML_MAX_DEPTH:
            raise _TooLarge(f"nested deeper than {YAML_MAX_DEPTH} levels", node)
        active.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        for child in children:
            total += size(child, depth + 1)
            if total > limit:
                raise _TooLarge(f"expands to more than {YAML_MAX_NODES} values with its aliases (an alias "
                                "bomb?); write the values out or use fewer aliases", node)
        active.discard(key)
        sizes[key] = total
        return total

    return size(root, 0)


def load(path: str | Path) -> RuleSet:
    return parse(read_yaml(path, what="rule file"), file=str(path))


def combine(sets: Iterable[RuleSet]) -> RuleSet:
    """One RuleSet from several; a rule id defined in two files is an error naming both."""
    rules: list[Rule] = []
    origin: list[tuple[str, str]] = []
    seen: dict[str, str] = {}
    problems: list[tuple[str, str]] = []
    last_file = "<rules>"
    for rs in sets:
        for rule in rs.rules:
            file = rs.file_of(rule.id) or "<rules>"
            last_file = file
            if rule.id in seen:
                problems.append((f"rule {rule.id}", f"already defined in {seen[rule.id]}"))
                continue
            seen[rule.id] = file
            rules.append(rule)
            origin.append((rule.id, file))
    if problems:
        raise ConfigError(last_file, problems)
    return RuleSet(tuple(rules), tuple(origin))


def load_all(paths: Iterable[str | Path]) -> RuleSet:
    return combine(load(p) for p in paths)


def default_rules_path() -> Path:
    """The default rule set shipped inside the package (``rules/default.yaml`` in a checkout links to it)."""
    return Path(__file__).resolve().parents[1] / "data" / "rules" / "default.yaml"


def rule_paths(rule_files: Sequence[str] | None, *, base_dir: Path) -> list[Path]:
    """A configuration's ``rule_files`` (relative to ``base_dir``), or the shipped default."""
    if not rule_files:
        return [default_rules_path()]
    return [p if p.is_absolute() else base_dir / p for p in map(Path, rule_files)]
