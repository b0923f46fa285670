"""Slow: real outside programs (systemd, nginx, podman, pip, vLLM's own code in ``.venv-vllm``) or the tuner's
processes against each other in real time. Every test here is marked ``slow`` (tests/conftest.py): ``make test``
runs them, ``make check`` does not. What each file needs:

- ``test_kube_agents.py``: real agents, launchers and simulated engines; Lease failover in real time
- ``test_launcher.py``: the real launcher and its engines' process groups, signal deadlines
- ``test_podman_pod.py``: a real podman pod
- ``test_systemd_units.py``: systemd-analyze and a real private systemd
- ``test_rolling.py``: real nginx in front of real engine processes under a load loop
- ``test_bench_client.py``: vLLM's own benchmark client, from .venv-vllm
- ``test_run_recovery.py``: `vllm-tuner run` killed and restarted mid-rollout, in real time
- ``test_live_apply.py``: the daemon's live rollouts on simulated replicas, in real time
- ``test_recommend_live.py``: `vllm-tuner recommend` scraping a simulated engine for its window
- ``test_cli_errors.py``: `vllm-tuner run` on busy ports, held locks, a full and a read-only mount
- ``test_secrets_shown.py``: `vllm-tuner run` and engine processes as subprocesses
- ``test_install.py``: python -m build, new virtualenvs, pip installs of the wheel, sdist and tree, and pipx
  install . (from the package index)
- ``test_systemd_install.py``: install.sh on a real private systemd; a rolling restart through polkit
- ``test_operating.py``: `vllm-tuner run` on simulated replicas, restarted; the CLI beside it
"""
