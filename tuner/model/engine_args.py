"""Engine command lines as values: parse, read and change them, through the one reader and writer.

``EngineArgs`` is an immutable, ordered list of argv items. It keeps what it does not understand
(positionals, unknown flags, their spelling: ``--flag value`` vs ``--flag=value``) so that
``EngineArgs.parse(argv).argv() == list(argv)`` and a change touches exactly one item. Reading and writing
go through ``tuner.portable.argv``, which the in-pod launcher patches its engine's command line with: one
reader and one writer of command lines for both. Nothing here runs a shell: ``from_string`` only splits the
CLI's ``--args`` text the way a shell would. ``tuner.model.knobs`` reads and writes knobs on these.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

from tuner.portable import argv as syntax
from tuner.portable.argv import Item

normalize_flag = syntax.normalize

Value = int | float | bool


def format_value(value: Value) -> str:
    """The argv text for a value: ``True``/``False`` → ``true``/``false``, 0.90 → ``0.9``, 512 → ``512``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if value.is_integer():
        return str(int(value))
    return f"{value:.6g}"


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """An engine command line. Immutable: every change returns a new value."""

    items: tuple[Item, ...] = ()
    _last: dict[str, int] | None = field(default=None, init=False, repr=False, compare=False, hash=False)
    """Each flag's spelling → the index of its last item, built on the first read (``_find``)."""

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def parse(cls, argv: Sequence[str]) -> EngineArgs:
        """Read like argparse (the launcher's reader: one for both)."""
        return cls(tuple(syntax.parse(argv)))

    @classmethod
    def from_string(cls, text: str) -> EngineArgs:
        """Split like a POSIX shell (quotes, escapes) — nothing is ever run through one."""
        return cls.parse(shlex.split(text))

    def argv(self) -> list[str]:
        return syntax.render(self.items)

    def __str__(self) -> str:
        return shlex.join(self.argv())

    def fingerprint(self) -> tuple[tuple[str, str], ...]:
        """Order- and spelling-independent identity (crash memory keys on it)."""
        out = []
        for item in self.items:
            if item.form == "positional":
                out.append(("", item.value or ""))
            else:
                out.append((item.key or "", "" if item.value is None else item.value))
        return tuple(sorted(out))

    # -- reading ---------------------------------------------------------------------------------
    def _find(self, flag: str) -> int | None:
        """``syntax.find`` (the last item for ``flag`` or its ``--no-`` form, either spelling) from an index of
        the items built once per command line: a step reads ~20 knobs, each a scan of the items otherwise."""
        last = self._last
        if last is None:
            last = {}
            for i, item in enumerate(self.items):
                if item.flag is not None:
                    last[syntax.normalize(item.flag)] = i
            object.__setattr__(self, "_last", last)
        key = syntax.normalize(flag)
        at, negated = last.get(key), last.get("--no-" + key[2:])
        if at is None or (negated is not None and negated > at):
            return negated
        return at

    def has(self, flag: str) -> bool:
        return self._find(flag) is not None

    def get(self, flag: str) -> str | bool | None:
        """The flag's text value; ``True``/``False`` for a bare ``--flag``/``--no-flag``; None if absent."""
        i = self._find(flag)
        if i is None:
            return None
        item = self.items[i]
        if item.form == "bare":
            return not (item.key or "").startswith("--no-") or normalize_flag(flag).startswith("--no-")
        return item.value

    def flags(self) -> list[str]:
        return [item.key for item in self.items if item.key is not None]

    # -- changing --------------------------------------------------------------------------------
    def with_value(self, flag: str, value: Value | str | None) -> EngineArgs:
        """Set ``flag`` (replacing its last occurrence in place, keeping its spelling and form, and dropping
        the earlier ones) or append it: ``syntax.with_value``, the launcher's writer. ``True``/``False`` on a
        boolean flag writes ``--flag`` / ``--no-flag``; ``None`` removes it; a number is written by
        ``format_value``."""
        text = value if value is None or isinstance(value, str | bool) else format_value(value)
        return EngineArgs(tuple(syntax.with_value(self.items, flag, text)))

    def without(self, flag: str) -> EngineArgs:
        return self.with_value(flag, None)
