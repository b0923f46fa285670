"""A pool of "pods" on this machine, for the agent's tests: the fake API server (tests/support/fake_kube.py,
the chart installed, its Role enforced), and per pod a loopback IP of its own (127.A.B.X, so every engine
listens on the same port, as pods do), a state directory (the pod's emptyDir), the real agent
(``vllm-tuner agent``, a process) and the real launcher (the zipapp the agent put in the state directory,
started only once desired.json is there: the wrapper `vllm-tuner inject` puts in front of it waits for it).

``Kubelet`` plays the kubelet and the endpoints controller: every ``period`` seconds it GETs each pod's
launcher ``/readyz`` and sets the pod's Ready condition in the API; ``on_ready`` is told each answer (the
tests route traffic with it: nginx upstreams for real engines, the simulator's own load for simulated ones).
It records the pool's Ready count over time (``min_ready``).

The Deployment controller is the test itself: ``add_pod`` and ``delete_pod`` (graceful: deletionTimestamp,
SIGTERM to the launcher as the kubelet sends it, then the object goes).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from harness import waiting
from tests.support import fake_kube as fk
from tests.support.launcher import LauncherProcess
from tuner.actuators import children
from tuner.portable import pod_protocol as protocol

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "llm"
POOL = "vllm"
LEASE = "vllm-tuner-vllm"
JOURNAL = "vllm-tuner-journal-vllm"
LABELS = {"vllm-tuner.io/pool": POOL, "app.kubernetes.io/name": "vllm"}
PROBE_PORT = 8081
ON_POD_IP = Path(__file__).resolve().parent / "on_pod_ip.py"


wait_for = functools.partial(waiting.wait_for, poll=0.2)


class AgentProcess:
    """``vllm-tuner agent`` for one pod, in its own process group."""

    def __init__(self, config: Path, *, pod: str, state_dir: Path, log_path: Path, startup_timeout: float = 30) -> None:
        self.argv = [sys.executable, "-m", "tuner", "agent", "--config", str(config), "--state-dir", str(state_dir),
                     "--pod", pod, "--startup-timeout", str(startup_timeout)]
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "POD_NAMESPACE": NAMESPACE,
                    "POD_NAME": pod}
        self.log_path, self.pod = log_path, pod
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> AgentProcess:
        if self.alive():  # (and one that has exited is reaped before it is replaced)
            raise RuntimeError(f"the agent of {self.pod} is running already")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, cwd=str(REPO), start_new_session=True)
        self.starts += 1
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc is not None:
            children.stop(self.proc, timeout_seconds=0, signal_first=None, group=True, kill_timeout_seconds=30)

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM to its group (SIGCONT first: it may be frozen), SIGKILL after ``timeout``, reaped."""
        if self.proc is None:
            return None
        self.signal(signal.SIGCONT)
        return children.stop(self.proc, timeout_seconds=timeout, group=True, kill_timeout_seconds=30)

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")
        return ""


@dataclass
class Pod:
    name: str
    ip: str
    state_dir: Path
    base_argv: list[str]
    agent: AgentProcess
    launcher: LauncherProcess | None = None
    deleted: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def probes(self) -> str:
        return f"http://{self.ip}:{PROBE_PORT}"

    def status(self) -> dict[str, Any]:
        return protocol.read_status(self.state_dir) or {}

    def desired(self) -> dict[str, Any]:
        with contextlib.suppress(OSError, ValueError):
            return dict(json.loads((self.state_dir / protocol.DESIRED).read_text()))
        return {}


class Kubelet:
    """Readiness probes → the pods' Ready condition (and ``on_ready`` for the routing)."""

    def __init__(self, pool: KubePool, *, period: float = 0.5,
                 on_ready: Callable[[Pod, bool], None] | None = None) -> None:
        self.pool, self.period, self.on_ready = pool, period, on_ready
        self.samples: list[tuple[float, dict[str, bool]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kubelet")

    def _run(self) -> None:
        with httpx.Client(timeout=2, trust_env=False) as client:
            while not self._stop.is_set():
                seen: dict[str, bool] = {}
                for pod in list(self.pool.pods.values()):
                    if pod.deleted or pod.launcher is None:
                        continue
                    try:
                        ready = client.get(pod.probes + "/readyz").status_code == 200
                    except httpx.HTTPError:
                        ready = False
                    with contextlib.suppress(KeyError):
                        self.pool.kube.set_ready(pod.name, ready)
                    seen[pod.name] = ready
                    if self.on_ready is not None:
                        try:
                            self.on_ready(pod, ready)
                        except Exception as exc:  # routing hiccups are the test's to see, not the kubelet's end
                            print(f"kubelet: on_ready({pod.name}) failed: {exc}", file=sys.stderr)
                self.samples.append((time.time(), seen))
                self._stop.wait(self.period)

    def start(self) -> Kubelet:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def ready_counts(self, since: float = 0.0) -> list[int]:
        """Ready pods at each sample (of the pods the kubelet probed then)."""
        return [sum(s.values()) for t, s in self.samples if t >= since and s]


class KubePool:
    def __init__(self, work: Path, *, config: Mapping[str, Any], engine_argv: list[str], engine_port: int,
                 launcher_python: str = sys.executable, launcher_options: Sequence[str] = (),
                 launcher_env: Mapping[str, str] | None = None, chart_values: Mapping[str, Any] | None = None) -> None:
        self.work = work
        self.kube = fk.from_chart({"pdb": {"enabled": True}, **(chart_values or {})}, namespace=NAMESPACE).start()
        self.token = work / "token"
        self.token.write_text(fk.AGENT_TOKEN)
        k = {"pool": POOL, "selector": {"matchLabels": {"vllm-tuner.io/pool": POOL}}, "lease": LEASE,
             "journal_configmap": JOURNAL, "pod_disruption_budget": POOL, "api_server": self.kube.url,
             "token_file": str(self.token), "ca_file": None, **config.get("kubernetes", {})}
        self.config = {**config, "kubernetes": k,
                       "daemon": {"listen_port": 0, **config.get("daemon", {})}}  # every agent on this machine
        self.config_path = self.write_config(work / "config.yaml")
        # every pod's command line: the engine's, through on_pod_ip.py (--host $POD_IP), as one Deployment runs it
        self.engine_argv = [launcher_python, str(ON_POD_IP), *engine_argv]
        self.engine_port, self.launcher_python = engine_port, launcher_python
        self.launcher_options, self.launcher_env = list(launcher_options), dict(launcher_env or {})
        self.pods: dict[str, Pod] = {}
        # a /24 of the loopback range of its own: pools of tests running at once (on one machine) never meet
        self._net = f"127.{random.randint(1, 254)}.{random.randint(0, 255)}"
        self._next_ip = 11
        self._starter: list[threading.Thread] = []

    def write_config(self, path: Path, **changes: Any) -> Path:
        """The pool's configuration with top-level ``changes`` (a section given whole), as a file."""
        path.write_text(yaml.safe_dump({**self.config, **changes}, sort_keys=False))
        return path

    # --- pods ----------------------------------------------------------------------------------------

    def add_pod(self, name: str, *, base_argv: list[str] | None = None, wait: bool = True,
                config_path: Path | None = None, startup_timeout: float = 30) -> Pod:
        """A pod: its object in the API, its agent (``config_path``: another configuration than the pool's),
        then its engine once the agent's start-up is done."""
        ip = f"{self._net}.{self._next_ip}"
        self._next_ip += 1
        state_dir = self.work / name
        state_dir.mkdir(parents=True)
        argv = list(base_argv if base_argv is not None else self.engine_argv)
        agent = AgentProcess(config_path or self.config_path, pod=name, state_dir=state_dir,
                             log_path=self.work / f"{name}.agent.log", startup_timeout=startup_timeout)
        pod = Pod(name, ip, state_dir, argv, agent)
        self.pods[name] = pod
        self.kube.add_pod(name, ip=ip, labels=LABELS)
        agent.start()
        starter = threading.Thread(target=self._start_engine, args=(pod,), daemon=True)
        starter.start()
        self._starter.append(starter)
        if wait:
            starter.join(timeout=120)
            assert pod.launcher is not None, agent.log()[-3000:]
        return pod

    def _start_engine(self, pod: Pod) -> None:
        """The wrapper's wait (launcher.pyz and desired.json in place), then the engine container."""
        zipapp, desired = pod.state_dir / protocol.ZIPAPP, pod.state_dir / protocol.DESIRED
        deadline = time.monotonic() + 120
        while not (zipapp.exists() and zipapp.stat().st_size and desired.exists() and desired.stat().st_size):
            if time.monotonic() > deadline or pod.deleted:
                return
            time.sleep(0.1)
        launcher = LauncherProcess(pod.state_dir, pod.base_argv, python=self.launcher_python, zipapp=zipapp, allowed=None,
                                   env={**self.launcher_env, "POD_IP": pod.ip},
                                   log_path=self.work / f"{pod.name}.launcher.log")
        launcher.argv = [self.launcher_python, str(zipapp), "--state-dir", str(pod.state_dir), "--probe-host", pod.ip,
                         "--probe-port", str(PROBE_PORT), "--poll", "0.2", "--health-url",
                         f"http://{pod.ip}:{self.engine_port}/health", *self.launcher_options, "--", *pod.base_argv]
        launcher.probe_port = PROBE_PORT
        pod.launcher = launcher.start()

    def delete_pod(self, name: str, *, grace: float = 60) -> None:
        """As the Deployment controller and the kubelet do: deletionTimestamp, SIGTERM to the containers,
        then the object goes."""
        pod = self.pods[name]
        self.kube.begin_delete(name)
        pod.deleted = True
        if pod.launcher is not None:
            pod.launcher.stop(timeout=grace)
        pod.agent.stop(timeout=30)
        self.kube.delete("Pod", name)

    # --- the API's view ------------------------------------------------------------------------------

    def data(self) -> dict[str, str]:
        cm = self.kube.get("ConfigMap", JOURNAL) or {}
        return dict(cm.get("data") or {})

    def doc(self, key: str, default: Any = None) -> Any:
        text = self.data().get(key)
        return json.loads(text) if text else default

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.data().get("journal", "").splitlines() if line.strip()]

    def report(self, name: str) -> dict[str, Any]:
        return self.doc(f"report.{name}", {}) or {}

    def lease(self) -> dict[str, Any]:
        return (self.kube.get("Lease", LEASE) or {}).get("spec") or {}

    def leader(self) -> str | None:
        holder = self.lease().get("holderIdentity")
        return holder.rsplit("_", 1)[0] if holder else None

    def diagnostics(self) -> str:
        out = [f"lease: {self.lease()}", f"desired: {self.doc('desired')}", f"pool: {self.doc('pool')}",
               "journal: " + "\n  ".join(json.dumps(r)[:300] for r in self.records()[-30:])]
        for pod in self.pods.values():
            out.append(f"--- {pod.name} agent ---\n" + pod.agent.log()[-2500:])
            if pod.launcher is not None:
                out.append(f"--- {pod.name} launcher ---\n" + pod.launcher.log_tail(15))
        return "\n".join(out)

    # --- teardown ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Every agent, then every launcher, each set at once (a leader's agent takes its ConfigMap watch's
        read timeout to stop; one after the other, the pool's teardown took tens of seconds)."""
        pods = list(self.pods.values())
        for pod in pods:  # an engine not yet started is not started now: its starter gives up at its next look
            pod.deleted = True
        for starter in self._starter:
            starter.join(timeout=10)
        try:
            with ThreadPoolExecutor(max(1, len(pods))) as pool:
                agents = [pool.submit(pod.agent.stop, timeout=20) for pod in pods]
                concurrent.futures.wait(agents)  # every one, even when one of them fails
                launchers = [pool.submit(pod.launcher.stop, timeout=60) for pod in pods if pod.launcher is not None]
                concurrent.futures.wait(launchers)
            for done in [*agents, *launchers]:
                done.result()  # the first failure, once every process was stopped
        finally:
            self.kube.stop()
