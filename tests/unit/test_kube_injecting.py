"""Adoption (tuner/kube/injecting.py), pure: what `vllm-tuner inject` does to a workload, and every
refusal, with the message a user sees."""

from __future__ import annotations

import copy
from typing import Any

import pytest

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
    with pytest.raises(inj.AdoptionError) as info:
        inj.inject([doc], SETTINGS)
    return str(info.value)


def test_vllms_own_shell_wrapped_example_is_refused_with_how_to_write_it():
    # vLLM's Kubernetes guide: command: ["/bin/sh", "-c"], args: ["vllm serve … --trust-remote-code"]
    message = refusal(workload(command=["/bin/sh", "-c"], args=["vllm serve meta-llama/Llama-3.2-1B-Instruct"]))
    assert message.startswith("Deployment/llm/llama: container vllm runs its engine through a shell")
    assert "no-op" in message and "command: [vllm, serve, MODEL" in message
    assert "through a shell" in refusal(workload(command=["bash", "-ec", "exec vllm serve m"]))


def test_a_command_line_in_args_only_is_refused():
    assert "args only" in refusal(workload(args=["--model", "m"]))


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
