"""vllm-tuner on Kubernetes: the agent, a native sidecar in every pod of a vLLM Deployment.

- ``api``: the API server, through lightkube (the requests the chart's Role allows, nothing else);
- ``electing``: one leader per pool, by a Lease; its epoch fences the pool's ConfigMap;
- ``store``: the pool's ConfigMap (journal, verified arguments, desired states, reports): fenced CAS;
- ``podside``: every agent's own pod: desired.json for its launcher, status.json back as a report;
- ``acting``: the leader's Actuator and Drainer over the pods' launchers, and the API's admission view;
- ``leading``: the leader's cycles over the pods (the tuner's one decision path and rollout driver);
- ``running``: the composition root (``vllm-tuner agent``).
"""
