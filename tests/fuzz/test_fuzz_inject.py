"""Fuzzing ``vllm-tuner inject`` (tuner/cli/injecting.py ``run``, tuner/kube/injecting.py): it runs as a
Helm post-renderer, so whatever a chart renders reaches it. Generated manifests — a real workload with
fields replaced by values of any type, shell scripts of shell metacharacters, collisions, aliases, alias
bombs of any fan-out and depth, arbitrary bytes — either adopt (exit 0, output that parses, adopts
again to the same text, passes the offline API checks) or are refused with ``error:`` lines (exit 2):
never a traceback, never a hang."""

from __future__ import annotations

import copy
from typing import Any

import yaml
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.support import fuzz, tried
from tuner.cli.injecting import run
from tuner.kube import injecting as inj
from tuner.rules import loading

SETTINGS = inj.Settings(image="ghcr.io/example/vllm-tuner:0.4.0")
SHELL = st.text(alphabet="vlm serv-MODEL0123 $;&|<>()`'\"\\\n*?#=~{}[]", max_size=40)
LEAF = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
        | st.sampled_from(["", "true", "vllm", "vllm-tuner-agent", "vllm-tuner-state", "vllm-tuner-config",
                           inj.STATE_DIR, "/bin/sh", "-c", "--shutdown-timeout", "1e300", "30", "vllm serve m",
                           2**63, 2**31, -1, 0]))
JUNK = st.recursive(LEAF, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                    max_leaves=12)


def workload() -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "llama", "namespace": "llm", "annotations": {inj.INJECT: "true", inj.POOL: "llama"}},
            "spec": {"selector": {"matchLabels": {"app": "llama"}},
                     "template": {"metadata": {"labels": {"app": "llama"}}, "spec": {
                         "containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
                                         "command": ["vllm", "serve", "m", "--shutdown-timeout", "30"]}]}}}}


# Where a mutation lands: a path into the workload (an int: a list index, created when missing).
PATHS = [
    ("kind",), ("apiVersion",), ("metadata",), ("metadata", "name"), ("metadata", "annotations"),
    ("metadata", "annotations", inj.POOL), ("metadata", "annotations", inj.ENGINE_CONTAINER), ("spec",),
    ("spec", "template"), ("spec", "template", "metadata"), ("spec", "template", "metadata", "labels"),
    ("spec", "template", "spec"), ("spec", "template", "spec", "containers"),
    ("spec", "template", "spec", "containers", 0), ("spec", "template", "spec", "containers", 0, "name"),
    ("spec", "template", "spec", "containers", 0, "image"), ("spec", "template", "spec", "containers", 0, "command"),
    ("spec", "template", "spec", "containers", 0, "args"), ("spec", "template", "spec", "containers", 0, "env"),
    ("spec", "template", "spec", "containers", 0, "volumeMounts"),
    ("spec", "template", "spec", "containers", 0, "livenessProbe"),
    ("spec", "template", "spec", "containers", 0, "readinessProbe"),
    ("spec", "template", "spec", "containers", 0, "startupProbe"),
    ("spec", "template", "spec", "containers", 1), ("spec", "template", "spec", "initContainers"),
    ("spec", "template", "spec", "volumes"), ("spec", "template", "spec", "terminationGracePeriodSeconds"),
]
CONTAINER = st.fixed_dictionaries({"name": st.sampled_from(["vllm", "side", inj.AGENT, "Bad_Name"])},
                                  optional={"image": st.text(max_size=10), "command": JUNK,
                                            "volumeMounts": st.lists(st.fixed_dictionaries({
                                                "name": st.sampled_from(["vllm-tuner-state", "x"]),
                                                "mountPath": st.sampled_from([inj.STATE_DIR, "/x"])}), max_size=2)})
VALUE = (JUNK | CONTAINER | st.lists(CONTAINER, max_size=3)
         | st.lists(st.fixed_dictionaries({"name": st.sampled_from([*inj.VOLUMES, "x"])},
                                          optional={"secret": JUNK, "emptyDir": st.just({}), "configMap": JUNK}),
                    max_size=3)
         | st.builds(lambda s: ["/bin/sh", "-c", s], SHELL) | st.builds(lambda s: [s], SHELL))


def put(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    node = doc
    for key in path[:-1]:
        if isinstance(node, dict):
            node = node.setdefault(key, {} if not isinstance(key, int) else [])
        elif isinstance(node, list) and isinstance(key, int):
            while len(node) <= key:
                node.append({})
            node = node[key]
        else:
            return
    last = path[-1]
    if isinstance(node, dict):
        node[last] = value
    elif isinstance(node, list) and isinstance(last, int):
        while len(node) <= last:
            node.append({})
        node[last] = value


@st.composite
def manifests(draw: st.DrawFn) -> list[Any]:
    docs: list[Any] = []
    for _ in range(draw(st.integers(1, 3))):
        doc = workload()
        for path, value in draw(st.lists(st.tuples(st.sampled_from(PATHS), VALUE), max_size=4)):
            put(doc, path, copy.deepcopy(value))
        docs.append(doc)
    if draw(st.booleans()):
        docs = [{"apiVersion": "v1", "kind": "List", "items": docs}]
    if draw(st.booleans()):
        docs.append(draw(JUNK))
    return docs


# What one value of the input may become in the output, at most: a YAML line with its indentation and a few
# characters of a scalar (measured: 10.6 characters a value for 83,521 aliased "x"s in an adopted Deployment).
CHARS_PER_VALUE = 16


def check(raw: bytes) -> tuple[int, str, list[str]]:
    code, out, lines = run(raw, "<fuzz>", SETTINGS)
    # bounded: no input may hold a post-renderer. Its work is linear in what it writes, and that is counted
    # here, not timed: a wall-clock bound failed under a loaded make test (11 s for an 11^4 alias tree that
    # takes 0.2 s of CPU) and passes on a stall it cannot tell from a loop
    assert len(out) <= CHARS_PER_VALUE * (loading.YAML_MAX_NODES + len(raw)), \
        "bounded: the output grows with the input and the alias budget, never past them"
    assert code in (0, 2)
    if code == 2:
        assert out == "" and lines and all(line.startswith(("error: ", "inject: ")) for line in lines), lines
    assert all("\n" not in line for line in lines), "one line per problem, warning or adoption"
    return code, out, lines


@fuzz(1)
@given(manifests())
def test_any_manifest_is_adopted_again_to_the_same_text_or_refused_in_lines(docs):
    tried("inject-manifests")
    try:
        text = yaml.safe_dump_all(docs, allow_unicode=True)
    except (yaml.YAMLError, ValueError, RecursionError):
        return
    code, out, _ = check(text.encode("utf-8"))
    if code == 0:
        again = loading.parse_yaml(out, what="output")
        for doc in inj.flatten(again):
            if isinstance(doc, dict) and inj.is_asked(doc) and (doc.get("apiVersion"), doc.get("kind")) in inj.WORKLOADS:
                assert inj.output_problems(doc) == []
        code2, out2, _ = check(out.encode("utf-8"))
        assert code2 == 0 and out2 == out, "adopting an adopted stream changes nothing"


@fuzz(0.4)
@given(st.integers(1, 12), st.integers(1, 12), st.booleans())
def test_alias_bombs_of_any_shape_are_bounded(fan_out, depth, adopt):
    tried("inject-alias-bombs")
    lines = ['a0: &a0 "x"']
    for i in range(1, depth + 1):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * fan_out)}]")
    prefix = ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n" if not adopt else
              yaml.safe_dump(workload()))
    code, _, lines_out = check((prefix + "\n".join(lines) + "\n").encode())
    if fan_out ** depth > loading.YAML_MAX_NODES:
        assert code == 2 and any("alias bomb" in line for line in lines_out)


@fuzz(0.4)
@given(st.binary(max_size=300))
def test_any_bytes_are_refused_or_read(raw):
    tried("inject-bytes")
    check(raw)
