"""Adoption (tuner/kube/injecting.py), pure: what `vllm-tuner inject` does to a workload, and every
refusal, with the message a user sees."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import shlex
import sys
from typing import Any

import pytest
import yaml

from tuner.kube import injecting as inj

SETTINGS = inj.Settings(image="registry.example/vllm-tuner:0.2.0")


def workload(kind: str = "Deployment", *, command: list[str] | None = None, args: list[str] | None = None,
             containers: list[dict[str, Any]] | None = None, annotations: dict[str, str] | None = None,
             grace: int | None = None) -> dict[str, Any]:
    engine: dict[str, Any] = {"name": "vllm", "image": "vllm/vllm-openai:v0.32.0"}
    if command is not None:
        engine["command"] = command
    if args is not None:
        engine["args"] = args
    spec: dict[str, Any] = {"containers": containers if containers is not None else [engine]}
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    return {"apiVersion": "apps/v1", "kind": kind,
            "metadata": {"name": "llama", "namespace": "llm",
                         "annotations": {inj.INJECT: "true", inj.POOL: "llama", **(annotations or {})}},
            "spec": {"selector": {"matchLabels": {"app": "llama"}},
                     "template": {"metadata": {"labels": {"app": "llama"}}, "spec": spec}}}


ARGV = ["vllm", "serve", "meta-llama/Llama-3.1-8B", "--port", "8000", "--shutdown-timeout", "30"]


def adopted(doc: dict[str, Any]) -> tuple[dict[str, Any], inj.Adopted]:
    (out,), (done,) = inj.inject([doc], SETTINGS)
    return out, done


def pod(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


def test_the_engine_command_is_wrapped_and_kept_whole_args_untouched():
    out, _ = adopted(workload(command=ARGV[:3], args=ARGV[3:]))
    (engine,) = pod(out)["containers"]
    cmd = engine["command"]
    assert cmd[:3] == ["python3", "-c", inj.WRAPPER] and cmd[3] == inj.STATE_DIR
    assert cmd[cmd.index("--") + 1:] == ARGV[:3] and engine["args"] == ARGV[3:]


def test_timeouts_are_derived_from_the_engines_shutdown_timeout():
    for shutdown, stop, grace in (("30", 45, 65), ("120", 135, 155), ("0", 15, 35)):
        out, done = adopted(workload(command=[*ARGV[:5], f"--shutdown-timeout={shutdown}"]))
        cmd = pod(out)["containers"][0]["command"]
        assert cmd[cmd.index("--stop-timeout") + 1] == str(stop) and done.stop_timeout_seconds == stop
        assert pod(out)["terminationGracePeriodSeconds"] == grace == done.grace_period_seconds
    out, _ = adopted(workload(command=ARGV, grace=600))
    assert pod(out)["terminationGracePeriodSeconds"] == 600, "a longer grace period of the user's is kept"


def test_the_agent_is_a_native_sidecar_that_gates_nothing():
    out, _ = adopted(workload(command=ARGV))
    spec = pod(out)
    (agent,) = spec["initContainers"]
    assert agent["name"] == inj.AGENT and agent["restartPolicy"] == "Always" and agent["image"] == SETTINGS.image
    assert "startupProbe" not in agent and "readinessProbe" not in agent
    config = next(v for v in spec["volumes"] if v["name"] == "vllm-tuner-config")
    assert config["configMap"] == {"name": "vllm-tuner-config-llama", "optional": True}


def test_the_agent_runs_at_the_restricted_level_without_a_fixed_uid():
    out, _ = adopted(workload(command=ARGV))
    sc = pod(out)["initContainers"][0]["securityContext"]
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"} and sc["runAsNonRoot"] is True
    assert "runAsUser" not in sc and sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}


def test_the_users_service_account_is_kept_and_the_token_goes_to_the_agent_only():
    doc = workload(command=ARGV)
    pod(doc)["serviceAccountName"] = "llama-sa"
    out, _ = adopted(doc)
    spec = pod(out)
    assert spec["serviceAccountName"] == "llama-sa" and spec["automountServiceAccountToken"] is False
    (agent,), (engine,) = spec["initContainers"], spec["containers"]
    assert any(m["mountPath"] == inj.TOKEN_DIR for m in agent["volumeMounts"])
    assert all(m["mountPath"] != inj.TOKEN_DIR for m in engine["volumeMounts"])


def test_probes_are_exec_probes_that_hold_without_the_launcher():
    out, _ = adopted(workload(command=ARGV))
    (engine,) = pod(out)["containers"]
    for key, what in (("readinessProbe", "readyz"), ("livenessProbe", "livez")):
        command = engine[key]["exec"]["command"]
        assert command[:5] == ["python3", "-I", "-S", "-c", inj.PROBE]
        assert command[5:] == [inj.STATE_DIR, what, str(inj.PROBE_PORT), "8000"]
    assert not any(p.get("containerPort") == inj.PROBE_PORT for p in engine.get("ports", []))


def test_the_engine_container_is_found_by_name_at_any_position():
    containers = [{"name": "router-sidecar", "image": "r", "command": ["r"]},
                  {"name": "engine", "image": "v", "command": ARGV}]
    out, done = adopted(workload(containers=containers, annotations={inj.ENGINE_CONTAINER: "engine"}))
    first, engine = pod(out)["containers"]
    assert first == containers[0] and engine["command"][-len(ARGV):] == ARGV and done.container == "engine"
    assert pod(out)["initContainers"][0]["env"][-1] == {"name": "VLLM_TUNER_ENGINE_CONTAINER", "value": "engine"}


def test_a_statefulset_is_adopted():
    out, done = adopted(workload("StatefulSet", command=ARGV))
    assert done.where == "StatefulSet/llm/llama" and pod(out)["initContainers"][0]["name"] == inj.AGENT


def test_the_pool_label_is_set_for_the_charts_selector():
    out, _ = adopted(workload(command=ARGV))
    labels = out["spec"]["template"]["metadata"]["labels"]
    assert labels[inj.POOL] == "llama" and labels[inj.AGENT_LABEL] == "true" and labels["app"] == "llama"


def test_adopting_twice_is_adopting_once():
    once, _ = adopted(workload(command=ARGV))
    twice, _ = adopted(copy.deepcopy(once))
    assert twice == once


def test_documents_that_do_not_ask_are_untouched():
    other = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}}
    plain = workload(command=ARGV)
    del plain["metadata"]["annotations"][inj.INJECT]
    out, done = inj.inject([other, plain], SETTINGS)
    assert out == [other, plain] and done == []


def refusal(doc: dict[str, Any]) -> str:
    with pytest.raises(inj.Refused) as info:
        inj.inject([doc], SETTINGS)
    return str(info.value)


@pytest.mark.parametrize(("kind", "api", "words"), [
    ("LeaderWorkerSet", "leaderworkerset.x-k8s.io/v1", "multi-node engine"),
    ("InferenceService", "serving.kserve.io/v1beta1", "KServe"),
    ("DaemonSet", "apps/v1", "one engine per node"),
])
def test_kinds_the_tuner_cannot_tune_are_refused_by_name(kind, api, words):
    doc = workload(command=ARGV)
    doc.update(kind=kind, apiVersion=api)
    message = refusal(doc)
    assert message.startswith(f"{kind}/llm/llama: ") and words in message and "Deployment or a StatefulSet" in message


def test_a_missing_engine_container_or_pool_is_refused():
    message = refusal(workload(containers=[{"name": "server", "image": "x", "command": ARGV}]))
    assert "no container named vllm (its containers: server)" in message and inj.ENGINE_CONTAINER in message
    doc = workload(command=ARGV)
    del doc["metadata"]["annotations"][inj.POOL]
    assert f"annotate it {inj.POOL}" in refusal(doc)


def test_a_shutdown_timeout_it_cannot_read_is_refused():
    assert "not a number of seconds" in refusal(workload(command=[*ARGV[:5], "--shutdown-timeout", "$(T)"]))


# --- what people run: a shell's one command, args after a known ENTRYPOINT, kind: List -----------------

SCRIPT = "vllm serve mistralai/Mistral-7B-Instruct-v0.3 --trust-remote-code --enable-chunked-prefill " \
         "--max_num_batched_tokens 1024"


def engine_of(doc: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod(doc)["containers"] if c["name"] == "vllm")


def wrapped(doc: dict[str, Any]) -> list[str]:
    command = engine_of(doc)["command"]
    return command[command.index("--") + 1:]


@pytest.mark.parametrize("shell", [["/bin/sh", "-c"], ["sh", "-c"], ["/bin/bash", "-ec"], ["bash", "-lc"]])
def test_vllms_own_shell_form_is_adopted_as_the_scripts_argv(shell):
    # vLLM's Kubernetes guide (docs/deployment/k8s.md): command: ["/bin/sh", "-c"], args: ["vllm serve …"]
    out, done = adopted(workload(command=shell, args=[SCRIPT]))
    assert wrapped(out) == shlex.split(SCRIPT) and "args" not in engine_of(out)
    assert done.notes and "adopted as its argv" in done.notes[0] and json.dumps(shlex.split(SCRIPT)) in done.notes[0]


@pytest.mark.parametrize(("script", "argv"), [
    ("exec vllm serve m --port 8000", ["vllm", "serve", "m", "--port", "8000"]),
    ("vllm serve 'my model' --served-model-name \"a b\"", ["vllm", "serve", "my model", "--served-model-name", "a b"]),
    ("vllm serve m \\\n  --port 8000\n", ["vllm", "serve", "m", "--port", "8000"]),
    ("vllm serve $(MODEL) --port 8000", ["vllm", "serve", "$(MODEL)", "--port", "8000"]),  # the kubelet's, env below
])
def test_one_simple_command_is_adopted(script, argv):
    doc = workload(command=["/bin/sh", "-c"], args=[script])
    engine_of(doc)["env"] = [{"name": "MODEL", "value": "m"}]
    out, _ = adopted(doc)
    assert wrapped(out) == argv


@pytest.mark.parametrize(("script", "why"), [
    ("pip install x && vllm serve m --port 8000", "more than one command"),
    ("vllm serve m; sleep 1", "more than one command"),
    ("vllm serve m | tee log", "more than one command"),
    ("vllm serve m > /tmp/log", "redirects"),
    ("vllm serve $MODEL", "expands variables"),
    ("vllm serve \"$MODEL\"", "expands variables"),
    ("vllm serve `cat m`", "expands"),
    ("vllm serve $(UNSET)", "expands"),
    ("vllm serve /models/*", "globbing"),
    ("HF_HOME=/x vllm serve m", "sets a variable"),
    ("vllm serve m\nvllm serve n", "more than one line"),
    ("vllm serve 'm", "quote is not closed"),
    ("vllm serve m # comment", "comment"),
])
def test_any_other_script_is_refused_with_the_list_form_to_paste(script, why):
    message = refusal(workload(command=["/bin/sh", "-c"], args=[script]))
    assert message.startswith("Deployment/llm/llama: container vllm runs its engine through a shell script") and why in message
    assert "no-op" in message and "command: [" in message


def test_a_script_with_and_and_names_the_exact_list_form():
    message = refusal(workload(command=["/bin/sh", "-c"], args=["pip install x && exec vllm serve m --port 8000"]))
    assert 'command: ["vllm", "serve", "m", "--port", "8000"]' in message and "init container" in message


def test_a_script_with_positional_parameters_is_refused():
    assert "followed by more arguments" in refusal(workload(command=["sh", "-c", "vllm serve $1", "x", "m"]))


@pytest.mark.parametrize(("image", "entrypoint"), [
    ("vllm/vllm-openai:v0.32.0", ["vllm", "serve"]), ("docker.io/vllm/vllm-openai:v0.12.0", ["vllm", "serve"]),
    ("vllm/vllm-openai:v0.9.2", ["python3", "-m", "vllm.entrypoints.openai.api_server"]),
    ("vllm/vllm-openai:v0.8.5.post1", ["python3", "-m", "vllm.entrypoints.openai.api_server"]),
])
def test_args_only_after_a_known_entrypoint_is_adopted(image, entrypoint):
    doc = workload(args=["--model", "m", "--shutdown-timeout", "30"])
    engine_of(doc)["image"] = image
    out, done = adopted(doc)
    assert wrapped(out) == entrypoint and engine_of(out)["args"] == ["--model", "m", "--shutdown-timeout", "30"]
    assert "args only" in done.notes[0] and done.stop_timeout_seconds == 45


@pytest.mark.parametrize("image", ["vllm/vllm-openai:v0.11.0", "vllm/vllm-openai:latest", "vllm/vllm-openai",
                                   "example.com/my/vllm:1.0"])
def test_args_only_after_an_unknown_entrypoint_is_refused_or_taken_from_the_flag(image):
    doc = workload(args=["m", "--port", "8000"])
    engine_of(doc)["image"] = image
    message = refusal(doc)
    assert "args only" in message and "--entrypoint vllm,serve" in message
    (out,), (done,) = inj.inject([doc], dataclasses.replace(SETTINGS, entrypoint=("vllm", "serve")))
    assert wrapped(out) == ["vllm", "serve"] and "--entrypoint" in done.notes[0]


def test_a_kind_list_is_adopted_item_by_item_and_stays_a_list():
    sh = workload(command=["/bin/sh", "-c"], args=[SCRIPT])
    args_only = workload(args=["m", "--shutdown-timeout", "30"])
    args_only["metadata"]["name"] = "qwen"
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}}
    (out,), done = inj.inject([{"apiVersion": "v1", "kind": "List", "items": [sh, service, args_only]}], SETTINGS)
    assert out["kind"] == "List" and [d["kind"] for d in out["items"]] == ["Deployment", "Service", "Deployment"]
    assert [d.where for d in done] == ["Deployment/llm/llama", "Deployment/llm/qwen"]
    assert wrapped(out["items"][0]) == shlex.split(SCRIPT) and wrapped(out["items"][2]) == ["vllm", "serve"]


def test_every_problem_of_every_workload_is_said_in_one_run():
    one = workload(command=["/bin/sh", "-c"], args=["a && vllm serve m"])
    two = workload(containers=[{"name": "server", "image": "x", "command": ARGV}])
    two["metadata"]["name"] = "two"
    three = workload(command=ARGV, grace=2**63)
    three["metadata"]["name"] = "three"
    with pytest.raises(inj.Refused) as info:
        inj.inject([one, two, three], SETTINGS)
    wheres = [p.where for p in info.value.problems]
    assert wheres == ["Deployment/llm/llama", "Deployment/llm/two", "Deployment/llm/three"]
    assert len(str(info.value).splitlines()) == 3


def test_warnings_for_no_shutdown_timeout_and_unpinned_images():
    doc = workload(command=["vllm", "serve", "m"])
    engine_of(doc)["image"] = "vllm/vllm-openai:latest"
    (_,), (done,) = inj.inject([doc], dataclasses.replace(SETTINGS, image="ghcr.io/example/vllm-tuner"))
    text = " ".join(done.warnings)
    assert "no --shutdown-timeout" in text and "vllm/vllm-openai:latest is :latest" in text
    assert "ghcr.io/example/vllm-tuner has no tag" in text
    assert all(line.startswith("warning: Deployment/llm/llama: ") for line in done.lines()[1:])
    _, pinned = adopted(workload(command=ARGV))
    assert pinned.warnings == ()


@pytest.mark.parametrize("image", ["UPPER/case:1", "x:tag with space", "a/b:", "@sha256:00", "a//b:1", "x@sha256:0"])
def test_a_malformed_agent_image_is_refused(image):
    with pytest.raises(inj.Refused, match="the agent image"):
        inj.inject([workload(command=ARGV)], dataclasses.replace(SETTINGS, image=image))


def test_an_image_by_digest_is_pinned():
    image = "ghcr.io/example/vllm-tuner@sha256:" + "a" * 64
    assert inj.image_problem(image) is None and inj.image_warning(image) is None
    for good in ("vllm/vllm-openai:v0.32.0", "localhost:5000/t:1", "registry.example:443/a/b_c:1.0-x", "library/ubuntu"):
        assert inj.image_problem(good) is None, good


# --- probes ---------------------------------------------------------------------------------------------


def test_the_users_probe_timings_are_kept_and_a_startup_probe_added():
    doc = workload(command=ARGV)
    engine_of(doc).update(  # vLLM's GPU example
        livenessProbe={"httpGet": {"path": "/health", "port": 8000}, "initialDelaySeconds": 60, "periodSeconds": 10},
        readinessProbe={"httpGet": {"path": "/health", "port": 8000}, "initialDelaySeconds": 60, "periodSeconds": 5})
    engine = engine_of(adopted(doc)[0])
    assert engine["livenessProbe"]["initialDelaySeconds"] == 60 and engine["livenessProbe"]["periodSeconds"] == 10
    assert engine["readinessProbe"]["initialDelaySeconds"] == 60 and engine["readinessProbe"]["periodSeconds"] == 2
    startup = engine["startupProbe"]
    assert startup["exec"]["command"][5:7] == [inj.STATE_DIR, "livez"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= SETTINGS.startup_seconds


def test_the_users_startup_probe_is_kept():
    doc = workload(command=ARGV)
    mine = {"httpGet": {"path": "/health", "port": 8000}, "failureThreshold": 120, "periodSeconds": 10}
    engine_of(doc)["startupProbe"] = mine
    once = adopted(doc)[0]
    assert engine_of(once)["startupProbe"] == mine and engine_of(adopted(copy.deepcopy(once))[0])["startupProbe"] == mine


def test_the_agent_has_a_liveness_probe_on_its_own_healthz():
    (agent,) = pod(adopted(workload(command=ARGV))[0])["initContainers"]
    live = agent["livenessProbe"]
    assert live["exec"]["command"] == ["python3", "-I", "-S", "-c", inj.AGENT_PROBE, str(inj.METRICS_PORT)]
    assert live["periodSeconds"] * live["failureThreshold"] >= 60


def test_the_charts_agent_settings_come_from_its_configmap_in_the_stream():
    chart = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "vllm-tuner-config-llama", "annotations": {
        inj.AGENT_SPEC: json.dumps({"image": "registry.example/t:9.9.9", "imagePullPolicy": "Always",
                                    "resources": {"limits": {"memory": "1Gi"}}, "livenessProbe": {"periodSeconds": 7}})}}}
    out, _ = inj.inject([chart, workload(command=ARGV)], dataclasses.replace(SETTINGS, image=None))
    (agent,) = pod(out[1])["initContainers"]
    assert agent["image"] == "registry.example/t:9.9.9" and agent["imagePullPolicy"] == "Always"
    assert agent["resources"] == {"limits": {"memory": "1Gi"}} and agent["livenessProbe"]["periodSeconds"] == 7
    out, _ = inj.inject([chart, workload(command=ARGV)], SETTINGS)
    assert pod(out[1])["initContainers"][0]["image"] == SETTINGS.image, "--image wins over the chart's"
    assert "no agent image was given" in refusal_with(workload(command=ARGV), dataclasses.replace(SETTINGS, image=None))


def refusal_with(doc: dict[str, Any], settings: inj.Settings) -> str:
    with pytest.raises(inj.Refused) as info:
        inj.inject([doc], settings)
    return str(info.value)


# --- hostile manifests: collisions, shapes, ranges ------------------------------------------------------


def test_a_users_volume_named_like_an_injected_one_is_refused_naming_both():
    doc = workload(command=ARGV)
    pod(doc)["volumes"] = [{"name": "vllm-tuner-config", "secret": {"secretName": "mine"}}]
    message = refusal(doc)
    assert "volume vllm-tuner-config (secret) has the name of the volume adoption adds (configMap)" in message
    doc = workload(command=ARGV)
    pod(doc)["volumes"] = [{"name": "vllm-tuner-config", "configMap": {"name": "my-own-settings"}}]
    assert "volume vllm-tuner-config (configMap) has the name of the volume adoption adds (configMap)" in refusal(doc)


def test_duplicate_container_names_and_a_mount_on_the_state_dir_are_refused():
    doc = workload(containers=[{"name": "vllm", "image": "v", "command": ARGV},
                               {"name": "vllm", "image": "w", "command": ["x"]}])
    assert "two containers are named vllm" in refusal(doc)
    doc = workload(command=ARGV)
    engine_of(doc)["volumeMounts"] = [{"name": "scratch", "mountPath": inj.STATE_DIR}]
    pod(doc)["volumes"] = [{"name": "scratch", "emptyDir": {}}]
    assert f"mounts its volume scratch at {inj.STATE_DIR}" in refusal(doc)
    doc = workload(command=ARGV)
    pod(doc)["initContainers"] = [{"name": inj.AGENT, "image": "mine"}]
    assert f"init container {inj.AGENT} is not the tuner's agent" in refusal(doc)


def test_a_command_string_is_refused_not_split_into_characters():
    doc = workload(command=ARGV)
    engine_of(doc)["command"] = "vllm serve m"
    assert 'command is a string, not a list' in refusal(doc) and '["vllm", "serve", "m"]' in refusal(doc)


@pytest.mark.parametrize("grace", [2**63, -1, "60", 1.5, True])
def test_a_grace_period_out_of_int64_is_refused(grace):
    assert "terminationGracePeriodSeconds" in refusal(workload(command=ARGV, grace=grace))


def test_a_shutdown_timeout_beyond_a_day_is_refused():
    assert "out of range" in refusal(workload(command=[*ARGV[:5], "--shutdown-timeout", "1e300"]))


@pytest.mark.parametrize(("path", "value"), [
    (("metadata",), "x"), (("spec",), []), (("spec", "template"), 3), (("spec", "template", "spec"), "x"),
    (("spec", "template", "spec", "containers"), {"name": "vllm"}), (("spec", "template", "spec", "containers"), ["x"]),
    (("spec", "template", "spec", "volumes"), "x"), (("spec", "template", "spec", "initContainers"), [1]),
])
def test_a_field_of_the_wrong_type_is_refused_not_a_traceback(path, value):
    doc = workload(command=ARGV)
    if path == ("metadata",):
        doc["spec"]["template"]["metadata"]["annotations"] = {inj.INJECT: "true", inj.POOL: "llama"}
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert "not a" in refusal(doc)


def test_labels_aliased_to_the_selector_do_not_change_the_selector():
    doc = workload(command=ARGV)
    shared = {"app": "llama"}
    doc["spec"]["selector"]["matchLabels"] = shared
    doc["spec"]["template"]["metadata"]["labels"] = shared  # what a YAML alias loads as
    out, _ = adopted(doc)
    assert out["spec"]["selector"]["matchLabels"] == {"app": "llama"}, "a Deployment's selector is immutable"
    assert out["spec"]["template"]["metadata"]["labels"][inj.POOL] == "llama"


def test_the_output_is_checked_against_what_the_api_server_would_refuse():
    out, _ = adopted(workload(command=ARGV))
    assert inj.output_problems(out) == []
    bad = copy.deepcopy(out)
    pod(bad)["containers"][0]["volumeMounts"].append({"name": "vllm-tuner-state", "mountPath": inj.STATE_DIR})
    pod(bad)["terminationGracePeriodSeconds"] = 2**63
    pod(bad)["containers"][0]["livenessProbe"]["periodSeconds"] = 2**31
    problems = inj.output_problems(bad)
    assert any("mounts two volumes at" in p for p in problems) and any("int64" in p for p in problems)
    assert any("int32" in p for p in problems)


# --- the command line: bounded input, one error line per problem, never a traceback ---------------------


def run_cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, stdin: str | bytes, *args: str
            ) -> tuple[int, str, str]:
    from tuner.cli import main

    raw = stdin.encode() if isinstance(stdin, str) else stdin
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(raw)))
    monkeypatch.delenv("VLLM_TUNER_IMAGE", raising=False)
    code = main(["inject", *args])
    out, err = capsys.readouterr()
    return code, out, err


BOMB = ('a: &a ["x","x","x","x","x","x","x","x","x"]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n'
        'c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\nd: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n'
        'f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\ng: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]\nh: [*g,*g,*g,*g,*g,*g,*g,*g,*g]\n')


def test_an_alias_bomb_is_refused_at_once(capsys, monkeypatch):
    """9^8 values in 300 bytes: refused on the composed node graph, before one value is constructed (counted,
    not timed: the count is what makes it fast on any machine)."""
    constructed: list[object] = []
    real = yaml.SafeLoader.construct_document
    monkeypatch.setattr(yaml.SafeLoader, "construct_document",
                        lambda self, node: constructed.append(node) or real(self, node))
    code, out, err = run_cli(capsys, monkeypatch, BOMB, "--image", SETTINGS.image)
    assert code == 2 and out == "" and "alias bomb" in err and err.startswith("error: inject: <stdin>")
    assert constructed == [], "nothing of the bomb was constructed"


def test_aliases_of_documents_it_does_not_adopt_are_written_back_as_aliases(capsys, monkeypatch):
    text = yaml.safe_dump(workload(command=ARGV)) + "---\n" + \
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata: {a: &x hello, b: *x}\nx: &l [1, 2]\ny: *l\n"
    code, out, err = run_cli(capsys, monkeypatch, text, "--image", SETTINGS.image)
    assert code == 0, err
    assert "&id001" in out and "*id001" in out, "the list shared by x and y is written once"
    docs = list(yaml.safe_load_all(out))
    assert docs[1]["y"] == [1, 2] and docs[1]["x"] is docs[1]["y"]


@pytest.mark.parametrize("wait", ["inf", "nan", "-1", "0", "1e9", "x"])
def test_wait_is_bounded(capsys, monkeypatch, wait):
    with pytest.raises(SystemExit) as info:
        run_cli(capsys, monkeypatch, "", "--image", SETTINGS.image, "--wait", wait)
    assert info.value.code == 2 and "--wait" in capsys.readouterr().err


def test_a_missing_or_directory_file_is_one_error_line(capsys, monkeypatch, tmp_path):
    for path, words in ((tmp_path / "absent.yaml", "no such file"), (tmp_path, "not a regular file")):
        code, _out, err = run_cli(capsys, monkeypatch, "", "--image", SETTINGS.image, "-f", str(path))
        assert code == 2 and words in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("text", ["{", "- [", "\xff", "a: !!python/object:os.system x", ": :"])
def test_input_that_is_not_yaml_is_one_error_line(capsys, monkeypatch, text):
    code, _out, err = run_cli(capsys, monkeypatch, text.encode("latin-1"), "--image", SETTINGS.image)
    assert code == 2 and err.startswith("error: inject: ") and "Traceback" not in err


def test_every_refusal_is_one_error_line_and_nothing_on_stdout(capsys, monkeypatch):
    one = workload(command=["/bin/sh", "-c"], args=["a && vllm serve m"])
    two = workload(command=ARGV, grace=2**64)
    two["metadata"]["name"] = "two"
    code, out, err = run_cli(capsys, monkeypatch, yaml.safe_dump_all([one, two]), "--image", SETTINGS.image)
    assert code == 2 and out == ""
    assert [line.split(":")[0:2] for line in err.splitlines()] == [["error", " Deployment/llm/llama"],
                                                                    ["error", " Deployment/llm/two"]]


def test_a_malformed_image_flag_is_refused(capsys, monkeypatch):
    code, _, err = run_cli(capsys, monkeypatch, "", "--image", "Not An Image")
    assert code == 2 and err.startswith("error: inject: --image: ")


def test_the_rewrite_and_the_warnings_are_in_the_output(capsys, monkeypatch):
    doc = workload(command=["/bin/sh", "-c"], args=["vllm serve m"])
    code, _out, err = run_cli(capsys, monkeypatch, yaml.safe_dump(doc), "--image", "ghcr.io/example/vllm-tuner:latest")
    assert code == 0
    lines = err.splitlines()
    assert lines[0].startswith("Deployment/llm/llama: adopted into pool llama")
    assert "adopted as its argv: command [\"vllm\", \"serve\", \"m\"]" in lines[1]
    assert any(line.startswith("warning: Deployment/llm/llama: the engine has no --shutdown-timeout") for line in lines)
    assert any("vllm-tuner:latest is :latest" in line for line in lines)


def test_duplicate_mount_paths_in_the_input_are_refused_not_passed_on():
    doc = workload(command=ARGV)
    engine_of(doc)["volumeMounts"] = [{"name": "a", "mountPath": "/x"}, {"name": "b", "mountPath": "/x"}]
    pod(doc)["volumes"] = [{"name": "a", "emptyDir": {}}, {"name": "b", "emptyDir": {}}]
    assert "container vllm mounts two volumes at /x" in refusal(doc)
