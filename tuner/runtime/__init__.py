"""What both roots run: the daemon (``vllm-tuner run``, ``tuner.daemon``) and the Kubernetes leader
(``tuner.kube``). The loop, the cycle, collecting, the dispatcher and the rollout driver, verification,
state, the views /status and the logs show, self-metrics and the status server."""
