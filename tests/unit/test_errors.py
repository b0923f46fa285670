"""The exception tree in tuner/errors.py names every TunerError the package defines, under its parent."""

from __future__ import annotations

import importlib
import pkgutil
import re

import tuner
from tuner import errors


def every_tuner_error() -> set[type[errors.TunerError]]:
    for info in pkgutil.walk_packages(tuner.__path__, "tuner."):
        if not info.name.startswith(("tuner.launcher", "tuner.sim", "tuner.__main__")):
            importlib.import_module(info.name)
    found: set[type[errors.TunerError]] = set()
    todo: list[type[errors.TunerError]] = [errors.TunerError]
    while todo:
        cls = todo.pop()
        found.add(cls)
        todo.extend(c for c in cls.__subclasses__() if c.__module__.startswith("tuner."))
    return found


def tree() -> dict[str, str | None]:
    """name → its parent's name, read from the drawing in the module docstring."""
    assert errors.__doc__ is not None
    parents: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []
    for line in errors.__doc__.splitlines():
        m = re.match(r"^[\s│]*(?:[├└]── )?(\w+(?:Error|Problem)|Deposed|Refused)\b", line)
        if m is None:
            continue
        depth = m.start(1)  # the column the name is drawn at
        while stack and stack[-1][0] >= depth:
            stack.pop()
        parents[m.group(1)] = stack[-1][1] if stack else None
        stack.append((depth, m.group(1)))
    return parents


def test_the_tree_names_every_tuner_error_under_its_parent() -> None:
    drawn = tree()
    for cls in every_tuner_error():
        assert cls.__name__ in drawn, f"{cls.__module__}.{cls.__name__} is missing from the tree in tuner/errors.py"
        if cls is not errors.TunerError:
            assert drawn[cls.__name__] == cls.__mro__[1].__name__, f"{cls.__name__} is drawn under the wrong parent"
