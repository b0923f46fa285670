"""Configuration: one YAML file, validated by pydantic v2.

Every model is frozen and forbids unknown keys; attribute docstrings become field descriptions
(``vllm-tuner config-schema`` prints them). ``load(path)`` raises ``ConfigError`` naming the file,
the field path and what was expected.
"""

from __future__ import annotations

import math
import posixpath
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tuner.actuators import settings as actuator_settings
from tuner.errors import ConfigError
from tuner.model import bounds, secrets
from tuner.planning import stepping
from tuner.planning.planner import DecisionSettings
from tuner.rules import loading
from tuner.rules.schema import unique


class _Model(bounds.Settings, BaseModel):  # model.bounds: finite numbers, durations a scheduler holds
    pass


class TlsSettings(_Model):
    verify: bool = True
    """Verify the server's certificate. Turn off only for a self-signed test endpoint."""
    ca_file: str | None = None
    """A CA bundle to verify against (PEM). None: the system's trust store."""
    client_cert_file: str | None = None
    """A client certificate (PEM, with its key) for mutual TLS. None: no client certificate."""


class ScrapeSettings(_Model):
    interval_seconds: float = Field(2.0, gt=0)
    """How often one cycle runs (scrape the engines → signals → plan → act). An engine's /metrics costs tens of
    milliseconds to read and parse, so the tuner reads it every few seconds and decides on fresh data: with
    2 s a load rise is seen within one or two scrapes (docs/rules.md#cadence)."""
    gpu_interval_seconds: float = Field(10.0, gt=0)
    """How often the GPUs' telemetry (dcgm-exporter, NVML) and the engine's model info are read; in between a
    cycle reuses the last reading. dcgm-exporter samples every 30 s by default, so reading it every cycle
    would only repeat its numbers."""
    decision_window_seconds: float | None = Field(20.0, gt=0)
    """The span rules decide on: the last this-many seconds, restarted at the tuner's own change and at a
    change point of the arrivals (a load rise or fall), so a decision reads only the regime it is for.
    ``window_seconds`` stays the span of what changes slowly (request sizes, KV sizing, idle time). None:
    rules read the whole window."""
    connect_timeout_seconds: float = Field(2.0, gt=0)
    """TCP/TLS connect timeout per request."""
    read_timeout_seconds: float = Field(5.0, gt=0)
    """Read timeout per request (between bytes, as httpx defines it)."""
    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0)
    """Largest /metrics body accepted; a larger one marks the window invalid (protects the tuner's
    memory from a runaway exporter). A vLLM body is ~50-150 KB."""
    window_seconds: float = Field(300.0, gt=0)
    """Span of history the slow signals are computed over (request sizes, what the KV cache holds for them, the
    length tails the --max-model-len floor keeps, idle time), and every signal when
    ``decision_window_seconds`` is None."""
    min_snapshots: int = Field(2, ge=2)
    """Fewest valid snapshots a window needs before any rate or quantile is trusted. 2: one interval, so a
    live raise can go out on the second scrape after a rise rather than the third (docs/rules.md#cadence:
    on the trace family, seed 7, p5 0.837 → 0.890 from the bad start, harm 0)."""
    stale_after_seconds: float | None = Field(None, gt=0)
    """Signals from a newest snapshot older than this are None. None: 2.5 × interval_seconds."""
    deadline_seconds: float = Field(5.0, gt=0)
    """Overall bound on each call to an engine or exporter (connect + headers + body): an endpoint that
    trickles bytes slower than the read timeout is cut off here. A vLLM scrape takes tens of ms."""
    bearer_token_file: str | None = None
    """File holding a bearer token sent to every engine and exporter (vLLM --api-key). None: none."""
    tls: TlsSettings = TlsSettings()

    def effective_stale_after(self) -> float:
        return self.stale_after_seconds or 2.5 * self.interval_seconds

    def gpu_stale_after(self) -> float:
        """GPU readings older than this are not used: 2.5 reads of ``gpu_interval_seconds`` (at least the
        engines' own limit)."""
        return max(self.effective_stale_after(), 2.5 * self.gpu_interval_seconds)

    def collect_deadline_seconds(self) -> float:
        """The whole gathering of one cycle: scrape, info and GPU reads, each bounded by deadline_seconds."""
        return 3 * self.deadline_seconds + 1.0

    def window_settings(self) -> stepping.WindowSettings:
        if self.decision_window_seconds is None:
            keep = max(8, min(100_000, math.ceil(self.window_seconds / self.interval_seconds) * 2 + 8))
        else:  # two decision windows in full, the rest thinned (stepping.thinned)
            recent = math.ceil(2 * self.decision_window_seconds / self.interval_seconds) + 1
            keep = max(8, min(100_000, recent + stepping.THIN_TO * 2 + 8))
        return stepping.WindowSettings(window_seconds=self.window_seconds, min_snapshots=self.min_snapshots,
                                       stale_after_seconds=self.effective_stale_after(), max_snapshots=keep,
                                       decision_seconds=self.decision_window_seconds,
                                       gpu_stale_after_seconds=self.gpu_stale_after())


class DcgmSettings(_Model):
    kind: Literal["dcgm"]
    url: str
    """dcgm-exporter's metrics URL, e.g. http://127.0.0.1:9400/metrics."""
    gpus: list[int] | None = None
    """The GPU indices (label ``gpu``) this engine uses. None: every GPU the exporter reports."""
    hostname: str | None = None
    """Keep only series whose Hostname/hostname label matches (a shared exporter). None: all."""
    slowdown_temp_c: float | None = None
    """dcgm-exporter does not export the slowdown threshold; set it (NVML's value, e.g. 89 on an
    H200) to get temp_margin_c. None: temp_margin_c is unknown for this target."""
    sm_clock_max_mhz: float | None = None
    """The GPUs' max SM clock, for sm_clock_ratio (dcgm-exporter does not export it). None: unknown."""


class NvmlSettings(_Model):
    kind: Literal["nvml"]
    devices: list[int] | None = None
    """NVML device indices this engine uses. None: all devices on this host."""


class NoGpuSettings(_Model):
    kind: Literal["none"]


GpuSettings = Annotated[DcgmSettings | NvmlSettings | NoGpuSettings, Field(discriminator="kind")]


class Target(_Model):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
    """Replica name, used in logs, plans and metric labels."""
    kind: Literal["vllm", "sglang"] = "vllm"
    """Which engine speaks at metrics_url."""
    metrics_url: str = Field(pattern=r"^https?://")
    """The engine's Prometheus endpoint, e.g. http://127.0.0.1:8000/metrics."""
    base_url: str | None = Field(None, pattern=r"^https?://")
    """Where /health, /v1/models and /version live. None: metrics_url without /metrics."""
    gpu: GpuSettings = NoGpuSettings(kind="none")
    """Where this engine's GPU telemetry comes from."""
    args: list[str] | None = None
    """The engine's arguments as it runs now (argv after the executable, e.g. ["--model", "m",
    "--max-num-seqs", "256"]). The tuner owns this command line in apply mode; in recommend mode it is
    what the rules reason about. None: unknown (rules needing a flag's value are held, with the reason).
    Secret values (``--api-key KEY``) are passed to the engine and masked wherever the tuner shows or
    stores arguments (docs/reliability.md, "Secrets")."""

    @field_validator("args")
    @classmethod
    def _one_line_each(cls, args: list[str] | None) -> list[str] | None:
        # An EnvironmentFile (systemd) cannot carry a newline, and no engine flag needs one; the value is
        # not quoted back (it may be a secret).
        for i, arg in enumerate(args or ()):
            if any(c in arg for c in "\n\r\0"):
                raise ValueError(f"argument {i} contains a newline or NUL byte; each argument is one line, "
                                 "e.g. [\"--max-num-seqs\", \"256\"]")
        return args


class DaemonSettings(_Model):
    listen_host: str = "127.0.0.1"
    """Address of the tuner's own /metrics, /healthz, /status and /recommendations. Loopback by default:
    expose it deliberately."""
    listen_port: int = Field(default=9180, ge=0, le=65535)
    """Port of that endpoint; 0 picks a free one."""
    status_from_network: bool = False
    """Serve /status and /recommendations to peers other than loopback too. Off: they answer 403 to
    anyone but 127.0.0.1/::1 even when listen_host is a pod's or host's address (they show engine
    arguments, secrets masked); /metrics and /healthz answer whoever reaches listen_host."""
    allowed_hosts: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$", max_length=253)]] = []
    """Names a request's ``Host`` header may carry on top of loopback names, IP addresses, ``listen_host``
    and this machine's name (e.g. a Service's DNS name that Prometheus scrapes). Any other name is answered
    421: a DNS-rebinding web page cannot read ``/status``."""
    json_logs: bool = False
    """One JSON object per log line instead of text."""
    maintenance_windows: list[str] = []
    """Crontab expressions (minute hour day month weekday) of the minutes in which restarts may happen;
    outside them restart plans are deferred, not dropped. Empty: restarts may happen at any time."""
    maintenance_timezone: str = "UTC"
    """Timezone the maintenance windows are read in."""
    health_max_age_seconds: float | None = Field(default=None, gt=0)
    """/healthz turns 503 when no cycle finished for this long. None: 3 × scrape.interval_seconds."""
    state_file: str = "/var/lib/vllm-tuner/state.json"
    """Where the engine arguments the tuner owns and each target's decision history (cooldowns,
    hysteresis, restart budget, crash memory) are persisted across restarts of the tuner."""
    secret_flags: list[Annotated[str, Field(pattern=r"^--[A-Za-z0-9][A-Za-z0-9_.-]*$")]] = []
    """Engine flags whose values are credentials, on top of the known ones (--api-key, --hf-token,
    --watermark-config, --admin-api-key): their values reach the engine and are masked (***) everywhere
    the tuner shows or stores arguments. E.g. ["--kv-transfer-config"]."""
    secret_env: list[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]] = []
    """Environment variables (actuator.env) whose values are credentials, on top of the known ones
    (HF_TOKEN, VLLM_API_KEY, OPENAI_API_KEY, AWS_SECRET_ACCESS_KEY, … and any name with a word such as
    TOKEN, SECRET, PASSWORD or KEY). E.g. ["MY_REGISTRY_PULL"]."""


class GpuControlSettings(_Model):
    enabled: bool = False
    """Allow privileged NVML actions (needs root). Off by default: the tuner changes engine flags, not
    hardware settings, unless told to."""
    power_limit_w: float = Field(default=500.0, gt=0)
    """While a GPU is thermally throttled (or inside decisions.thermal.margin_c of its slowdown
    temperature), lower its power limit to this (clamped to the board's constraints); restore the
    board's default once the condition clears."""
    devices: list[int] = []
    """NVML indices to act on. Empty: none, even when enabled."""


class LiveSettings(_Model):
    enabled: bool = False
    """Change the admission cap (``--max-num-seqs`` semantics inside the startup envelope) and, where the
    engine says it is safe, the step budget live — no drain, no restart, no warm-up — through the
    engine's own live API where it has one (preferred: vLLM pull request 55018's ``/trimtab/set_knobs`` or
    54816's ``/v1/runtime_config``, both with ``VLLM_SERVER_DEV_MODE=1``; SGLang's ``/set_internal_state`` with
    pull request 37661), else the engine-side plugin (``vllm-tuner-plugin``, plugin/README.md; vLLM only). The
    tuner probes which one an engine offers (docs/engine-contract.md §8). A change beyond the envelope still
    goes through a rolling restart. Off by default."""
    control_dir: str = "/var/lib/vllm-tuner/live/{name}"
    """The directory the engine's plugin reads (its ``VLLM_TUNER_CONTROL_DIR``); ``{name}`` is the target's
    name. The tuner creates it private (0700); the engine must run as the tuner's uid. The process
    actuator passes it to each engine it starts; systemd units and pods must set it themselves."""
    verify_seconds: float = Field(default=30.0, ge=0)
    """How long a live change is judged before it is kept (the restart path's is ``rollout.verify_seconds``):
    evidence proportional to cost — a live change is undone in a second, so it is judged over about one
    decision window of the new regime (``scrape.decision_window_seconds``) and a margin, not over the two
    minutes a restarted engine needs to settle."""
    ack_timeout_seconds: float = Field(default=30.0, gt=0)
    """How long a live change may take to be acknowledged by every engine core (an idle engine answers at
    its next step: the tuner sends it one tiny request after a couple of seconds)."""

    def dir_for(self, name: str) -> str:
        return self.control_dir.replace("{name}", name)


def engine_address(url: str) -> str:
    """Where ``url`` lands, for telling two targets' engines apart: scheme, host (any loopback spelling as
    one), port (the scheme's default filled in) and path without a trailing slash."""
    parts = urlsplit(url.strip())
    host = (parts.hostname or "").lower().rstrip(".")
    if host == "localhost" or host.startswith("127.") or host == "::1":
        host = "loopback"
    try:
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    except ValueError:
        port = 0
    return f"{parts.scheme.lower()}://{host}:{port}{parts.path.rstrip('/')}"


def _one_engine_each(targets: list[Target], live: LiveSettings) -> None:
    """Each target is one engine of its own: two targets on one URL are one engine counted twice (or two
    engines behind a Service, read as one that restarts at every flip), and one control directory for two
    targets sends a live change meant for one to all, bypassing one-at-a-time."""
    seen: dict[str, str] = {}
    for t in targets:
        for what, url in (("metrics_url", t.metrics_url), ("base_url", t.base_url or "")):
            if not url:
                continue
            key = f"{what}:{engine_address(url)}"
            if key in seen and seen[key] != t.name:
                raise ValueError(
                    f"targets {seen[key]!r} and {t.name!r} have the same {what} ({url}): each target must reach "
                    "one engine of its own, e.g. http://127.0.0.1:8000/metrics and http://127.0.0.1:8001/metrics "
                    "(not a Service or load balancer in front of several)")
            seen[key] = t.name
    if len(targets) > 1:
        if "{name}" not in live.control_dir:
            raise ValueError(
                f"live.control_dir {live.control_dir!r} has no {{name}}: every target would read one control file, "
                "so a live change meant for one replica would reach all at once; e.g. /var/lib/vllm-tuner/live/{name}")
        dirs: dict[str, str] = {}
        for t in targets:
            d = posixpath.normpath(live.dir_for(t.name))
            if d in dirs:
                raise ValueError(f"live.control_dir gives targets {dirs[d]!r} and {t.name!r} one directory ({d}); "
                                 "e.g. /var/lib/vllm-tuner/live/{name}")
            dirs[d] = t.name


_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# A label key: an optional DNS-subdomain prefix and "/", then a name of up to 63 characters.
_LABEL_KEY = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
_LABEL_VALUE = r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$"
LabelKey = Annotated[str, Field(pattern=_LABEL_KEY, max_length=316)]
LabelValue = Annotated[str, Field(pattern=_LABEL_VALUE, max_length=63)]


class SelectorRequirement(_Model):
    key: LabelKey
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[LabelValue] = []
    """Required (non-empty) for In and NotIn; must be empty for Exists and DoesNotExist."""

    @model_validator(mode="after")
    def _values_fit_the_operator(self) -> SelectorRequirement:
        if self.operator in ("In", "NotIn") and not self.values:
            raise ValueError(f"operator {self.operator} needs values, e.g. {{key: app, operator: In, values: [vllm]}}")
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise ValueError(f"operator {self.operator} takes no values")
        return self


class LabelSelector(_Model):
    """A Kubernetes label selector, spelled as in a Deployment (``matchLabels``, ``matchExpressions``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, populate_by_name=True)
    match_labels: dict[LabelKey, LabelValue] = Field(default={}, alias="matchLabels")
    match_expressions: list[SelectorRequirement] = Field(default=[], alias="matchExpressions")

    @model_validator(mode="after")
    def _not_everything(self) -> LabelSelector:
        if not self.match_labels and not self.match_expressions:
            raise ValueError("an empty selector matches every pod of the namespace; give matchLabels, "
                             "e.g. {matchLabels: {vllm-tuner.io/pool: vllm}}")
        return self


class KubernetesSettings(_Model):
    """The pool on Kubernetes (``vllm-tuner agent``): the agent runs in every pod of the pool, the pods
    are the targets, and each pod's launcher is its actuator (docs/kubernetes.md, "The agent")."""

    pool: str = Field(pattern=_DNS_LABEL, max_length=63)
    """The pool's name, in logs and metric labels."""
    selector: LabelSelector
    """The pool's pods (the Deployment's pod labels). Every pod it matches is a replica of the pool."""
    lease: str = Field(pattern=_DNS_SUBDOMAIN, max_length=253)
    """The Lease the agents elect their leader with (created by the chart: the agents may not create it)."""
    journal_configmap: str = Field(pattern=_DNS_SUBDOMAIN, max_length=253)
    """The ConfigMap holding the pool's journal, its verified arguments and each pod's desired state and
    report (created by the chart)."""
    pod_disruption_budget: str | None = Field(None, pattern=_DNS_SUBDOMAIN, max_length=253)
    """The pool's PodDisruptionBudget: no replica is drained while it allows no disruption. None: not read."""
    namespace: str | None = Field(None, pattern=_DNS_LABEL, max_length=63)
    """The pool's namespace. None: the pod's own ($POD_NAMESPACE, else the service account's)."""
    engine_container: str = Field("vllm", pattern=_DNS_LABEL, max_length=63)
    """The engine's container (its command starts with the launcher)."""
    engine_kind: Literal["vllm", "sglang"] = "vllm"
    """Which engine the pods run."""
    engine_port: int = Field(8000, ge=1, le=65535)
    """The engine's port on the pod IP (/metrics, /health, /v1/models)."""
    engine_scheme: Literal["http", "https"] = "http"
    state_dir: str = "/var/run/vllm-tuner"
    """The directory shared with the launcher (the pod's emptyDir): launcher.pyz, desired.json, status.json."""
    max_unavailable: int = Field(1, ge=1)
    """At most this many of the pool's pods out of service at once (not Ready, counted from the API
    server, plus the one about to be drained). The rollout's own rule (rollout.max_unavailable) holds too."""
    drain_grace_seconds: float = Field(10.0, ge=0, le=3600)
    """After a drained pod is seen not Ready by the API server, wait this long (endpoints, kube-proxy and
    routers catch up) before its in-flight check and relaunch."""
    shutdown_timeout_seconds: float = Field(30.0, gt=0, le=3600)
    """The engine's --shutdown-timeout: a relaunch may take this long to stop the old engine (plus a
    margin) before the launcher reports the new one starting."""
    api_server: str | None = Field(None, pattern=r"^https?://")
    """The API server's URL. None: in the cluster ($KUBERNETES_SERVICE_HOST and _PORT, the service
    account's CA)."""
    token_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    """The service account's token (re-read at every request: projected tokens rotate)."""
    ca_file: str | None = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    """The API server's CA bundle (https only). None: the system's trust store."""
    lease_duration_seconds: float = Field(15.0, gt=0, le=600)
    """A leader that has not renewed its Lease for this long is replaced (client-go's default)."""
    renew_deadline_seconds: float = Field(10.0, gt=0, le=600)
    """A leader that could not renew for this long stops acting (before anyone else may take over)."""
    retry_period_seconds: float = Field(2.0, gt=0, le=60)
    """How often the Lease is renewed or tried."""
    request_timeout_seconds: float = Field(10.0, gt=0, le=120)
    """Bound on each call to the API server."""
    report_timeout_seconds: float = Field(60.0, gt=0, le=3600)
    """How long the leader waits for a pod's agent to carry out a desired state (drain, relaunch request)
    and report it back before the step counts as failed."""

    @model_validator(mode="after")
    def _deadlines(self) -> KubernetesSettings:
        if not self.retry_period_seconds < self.renew_deadline_seconds < self.lease_duration_seconds:
            raise ValueError("need retry_period_seconds < renew_deadline_seconds < lease_duration_seconds (a "
                             "leader must stop acting before another may take its Lease), e.g. 2 < 10 < 15")
        return self


class TunerSettings(_Model):
    """The whole configuration file."""

    mode: Literal["observe", "recommend", "apply"] = "observe"
    """observe: collect and expose signals; recommend: also plan, log and serve recommendations
    (a true dry run, never touches an engine); apply: also roll the changes out."""
    targets: list[Target] = []
    """The engine replicas this tuner watches (at least one), unless ``kubernetes:`` is given: there the
    pool's pods are the targets."""
    scrape: ScrapeSettings = ScrapeSettings()
    rule_files: list[str] | None = None
    """Rule files, relative to this config file's directory (and inside it) unless absolute. None: the default rule set
    shipped with vllm-tuner (rules/default.yaml)."""
    decisions: DecisionSettings = DecisionSettings()
    """Guards and planner settings: thermal, idle, safety (cooldowns, hysteresis, restart budget), engine
    facts (platform, GPU memory, known defaults)."""
    daemon: DaemonSettings = DaemonSettings()
    actuator: actuator_settings.ActuatorSettings | None = None
    """How engines are restarted (apply mode only): process | systemd."""
    drain: actuator_settings.DrainSettings = actuator_settings.NoDrainSettings(kind="none")
    """How a replica is taken out of the load balancer before its restart: nginx | command | http | none."""
    rollout: actuator_settings.RolloutSettings = actuator_settings.RolloutSettings()
    gpu_control: GpuControlSettings = GpuControlSettings()
    """Privileged GPU actions (power limit under thermal throttling). Off by default."""
    live: LiveSettings = LiveSettings()
    """Live knobs (no restart) through the engine's own live API or the engine-side plugin. Off by default."""
    kubernetes: KubernetesSettings | None = None
    """The pool's pods on Kubernetes (``vllm-tuner agent``) instead of ``targets``; the pods' launchers
    are the actuator and their readiness the drain, so ``actuator`` and ``drain`` are not given."""

    @model_validator(mode="after")
    def _targets_or_kubernetes(self) -> TunerSettings:
        if self.kubernetes is None:
            if not self.targets:
                raise ValueError("targets: give at least one target (or a `kubernetes:` section, whose pods are "
                                 "the targets), e.g. targets: [{name: a, metrics_url: 'http://127.0.0.1:8000/metrics'}]")
            unique([t.name for t in self.targets], what="target names")
            _one_engine_each(self.targets, self.live)
            return self
        clash = [k for k, given in (("targets", bool(self.targets)), ("actuator", self.actuator is not None),
                                    ("drain", self.drain.kind != "none")) if given]
        if clash:
            raise ValueError(f"with `kubernetes:` the pool's pods are the targets, their launchers the actuator and "
                             f"their readiness the drain: remove {', '.join(clash)}")
        return self

    @field_validator("rule_files")
    @classmethod
    def _inside_the_config_directory(cls, files: list[str] | None) -> list[str] | None:
        # A relative path is read from the configuration's directory and must stay in it: a `..` that
        # climbs out is refused (a file elsewhere is named by its absolute path, deliberately).
        for i, f in enumerate(files or ()):
            if not f.strip():
                raise ValueError(f"rule_files[{i}] is empty; expected a rule file, e.g. \"rules/site.yaml\"")
            if not posixpath.isabs(f) and posixpath.normpath(f).split("/")[0] == "..":
                raise ValueError(f"rule_files[{i}] {f!r} climbs out of the configuration's directory; a relative "
                                 "path stays inside it (e.g. \"rules/site.yaml\"), a file elsewhere is named by its "
                                 "absolute path (e.g. \"/etc/vllm-tuner/rules.yaml\")")
        return files

    def redactor(self, *, token: str | None = None) -> secrets.Redactor:
        """What counts as secret for this configuration: the known flags and names, ``daemon.secret_flags``
        and ``secret_env``, and every secret value it holds (targets' flags, actuator.env, passwords and
        tokens in URLs, the bearer token read from scrape.bearer_token_file)."""
        base = secrets.DEFAULT.extended(flags=self.daemon.secret_flags, env=self.daemon.secret_env)
        urls = [u for t in self.targets for u in (t.metrics_url, t.base_url) if u]
        urls += [t.gpu.url for t in self.targets if isinstance(t.gpu, DcgmSettings)]
        if isinstance(self.drain, actuator_settings.HttpDrainSettings):
            urls += [self.drain.drain_url, self.drain.undrain_url]
        env = self.actuator.env if isinstance(self.actuator, actuator_settings.ProcessActuatorSettings) else {}
        return base.learn(argvs=[t.args for t in self.targets if t.args], env=env, urls=urls,
                          values=[token] if token else [])

    def redacted_dump(self, redactor: secrets.Redactor | None = None) -> dict[str, Any]:
        """The effective configuration as JSON data, every secret masked (``check-config``, the log)."""
        data: dict[str, Any] = (redactor or self.redactor()).data(self.model_dump(mode="json"))
        return data

    @property
    def kind(self) -> Literal["vllm", "sglang"]:
        """The engines' kind (every target's, or the pool's on Kubernetes)."""
        return self.kubernetes.engine_kind if self.kubernetes is not None else self.targets[0].kind

    def apply_problems(self) -> list[tuple[str, str]]:
        """What apply mode still needs (checked by `run` and `check-config`, not by the schema, so a
        configuration can be validated piecewise)."""
        if self.mode != "apply":
            return []
        problems: list[tuple[str, str]] = []
        if self.kubernetes is not None:  # the pods bring their arguments; their launchers are the actuator
            return problems
        if self.actuator is None:
            problems.append(("actuator", "mode apply needs an `actuator:` section (kind: process or systemd)"))
        problems += [(f"targets[{i}].args", "mode apply needs the engine's current arguments (argv list)")
                     for i, t in enumerate(self.targets) if t.args is None]
        if self.decisions.idle.sleep_after_seconds is not None:
            for i, t in enumerate(self.targets):
                if t.kind != "vllm" or t.args is None:
                    continue
                lacking = [f for f in ("--enable-sleep-mode", "--enable-server-load-tracking") if f not in t.args]
                if lacking:
                    problems.append((f"targets[{i}].args", (
                        f"decisions.idle.sleep_after_seconds needs the engine started with {' and '.join(lacking)} "
                        "(and VLLM_SERVER_DEV_MODE=1 in its environment): without sleep mode it cannot sleep, and "
                        "without load tracking a request sent to a sleeping engine is never seen, so it is "
                        "never woken")))
        if len(self.targets) == 1 and self.rollout.allow_downtime and not self.daemon.maintenance_windows:
            problems.append(("daemon.maintenance_windows", "a single replica restarted with allow_downtime takes "
                             "the service down: restarts must be confined to maintenance windows (e.g. "
                             "['* 3-4 * * *'])"))
        return problems


def _where(loc: tuple[Any, ...], data: Any = None) -> str:
    """``('actuator', 'process', 'command', 0)`` → ``actuator.command[0]``: a discriminated union's tag
    (the ``kind:`` the data names, not a field) is left out."""
    out = ""
    node = data
    for part in loc:
        if isinstance(node, dict) and isinstance(part, str) and part not in node and node.get("kind") == part:
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
        try:
            node = node[part] if node is not None else None
        except (KeyError, IndexError, TypeError):
            node = None
    return out


def _what(err: Any) -> str:
    msg = str(err["msg"])
    if err["type"] == "extra_forbidden":
        return "unknown field (not part of the schema; see `vllm-tuner config-schema`)"
    if err["type"] == "missing":
        return "required field is missing"
    if err["type"] == "value_error":  # our own validators: the message says what and quotes an example
        return msg.removeprefix("Value error, ")
    if "input" in err and err["type"] not in ("model_type",):
        if {"args", "env", "bearer_token_file"} & {str(p) for p in err["loc"]}:
            return msg  # the value given may be a secret: the field path says where
        given = repr(secrets.DEFAULT.data(err["input"]))
        return f"{msg}; got {given[:80]}"
    return msg


def parse(data: Any, *, file: str = "<config>") -> TunerSettings:
    if data is None:
        raise ConfigError(file, [("", "the file is empty; expected a mapping with at least `targets:`")])
    if not isinstance(data, dict):
        raise ConfigError(file, [("", f"expected a mapping at the top level, got {type(data).__name__}")])
    try:
        return TunerSettings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(file, [(_where(e["loc"], data), _what(e)) for e in exc.errors()]) from exc


def load(path: str | Path, *, runnable: bool = True) -> TunerSettings:
    """Read and validate a configuration file; ``runnable``: also what its mode needs to run."""
    settings = parse(loading.read_yaml(path, what="configuration file"), file=str(path))
    if runnable and (problems := settings.apply_problems()):
        raise ConfigError(str(path), problems)
    return settings


def schema() -> dict[str, Any]:
    return TunerSettings.model_json_schema()
