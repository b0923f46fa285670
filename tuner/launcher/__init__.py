"""vllm-tuner's in-pod engine launcher (stdlib only; it runs under the engine image's Python, 3.10+).

The engine container's command becomes ``python3 /var/run/vllm-tuner/launcher.pyz -- <the engine's
command>``. The launcher is that container's PID 1: it runs the engine with the overrides the agent
writes to the shared directory (``tuner.portable.pod_protocol``), relaunches it in place on request (no container
restart, so no CrashLoopBackOff between a change and its rollback), answers the kubelet's probes
(``probes``) and forwards its SIGTERM. docs/kubernetes.md describes the protocol and the manifests.

This package is that program only. It stands on the ground floor, ``tuner.portable`` (the command-line
writer, the secrets mask, the bounded reader, the pod's files), which its zipapp carries beside it
(``packaging``); nothing here imports the rest of ``tuner`` or any third-party module (import-linter holds
that).
"""

PROTOCOL_VERSION = 1
