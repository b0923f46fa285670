"""A real ``podman kube play`` for tests (Debian's podman 4.3), pod-shaped, without a registry.

What makes it work on this kind of machine (a VM with a hybrid cgroup v1 tree and a read-only tmpfs on
/sys/fs/cgroup), each measured here:

- **ulimits**: podman's default ``nofile`` is above what the VM allows (``crun: setrlimit RLIMIT_NOFILE:
  Operation not permitted``): a private ``containers.conf`` (``$CONTAINERS_CONF``) lowers the defaults.
- **cgroups**: crun refuses the hybrid tree ("cgroups in hybrid mode not supported") and cannot write
  the read-only one: every podman command runs in a private mount namespace (``unshare --mount``) where
  a fresh tmpfs on /sys/fs/cgroup holds only the v1 hierarchies (the kernel's own, shared with the host;
  nothing changes outside the namespace).
- **network**: ``--network none`` (the pod still has its own loopback, shared by its containers).
- **images**: the agent's own image (above); for the engine and the API server, ``podman import`` of a
  skeleton root file system (merged-/usr symlinks and a few /etc files, a few KB); the host's /usr, the Python the virtualenvs link to (/root/.pyenv), the virtualenvs
  and the model come in as hostPath volumes, read-only, instead of a 3.5 GB image.
- **storage**: its own ``--root`` under /var/tmp (kept between runs: the imported image is cached there)
  and ``--runroot`` under /run, so nothing touches the machine's default podman storage.

podman 4.3 ignores readiness probes and has no native sidecars (init containers with
``restartPolicy: Always``): tests render those as an init container plus an ordinary container.

**The agent and the API server.** The agent is the real one, in the image ``make image`` builds
(``Podman.agent_image``: deploy/image/build.sh into this storage, once per state of the tree), as that
image's user 65532:0 while the engine runs as root (``playable_overlay(agent_image=...)``; without it,
``python -m tuner agent`` from the project's virtualenv as a hostPath volume, as root): its start-up
(``--prepare-only``) as the init container, then the agent itself as an ordinary container. The pod has no network but its own loopback,
so the Kubernetes API is the fake one (tests/support/fake_kube.py, stdlib only, under the host's Python)
**run inside the pod** as one more container, on 127.0.0.1:6443, loaded with the chart's Role, Lease,
journal ConfigMap and this pod's object. The chart's ConfigMap gets ``api_server``/``token_file`` for it
(the one change to the rendered configuration). The init container cannot reach that API yet (ordinary
containers start after init containers): its start-up falls back to the pod's own command line after
``--startup-timeout``, which is what a real agent does when the API is unreachable.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness import waiting

ROOT = Path("/var/tmp/vllm-tuner-podman")
RUNROOT = Path("/run/vllm-tuner-podman")
SKELETON = "localhost/vllm-tuner-test-rootfs:2"  # bump when import_skeleton changes
AGENT_IMAGE = "localhost/vllm-tuner"  # the agent's image, as `make image` builds it (tagged by its inputs)
IMAGE_CACHE = ROOT / "image-cache"  # deploy/image/build.sh's CACHE: root file systems and wheels

CONTAINERS_CONF = """\
# vllm-tuner's test podman: default ulimits no higher than this machine's hard limits (nproc 65536 was refused here, 32768 works), no journald.
[containers]
default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]
log_driver = "k8s-file"

[engine]
events_logger = "file"
cgroup_manager = "cgroupfs"
"""

# Run inside `unshare --mount --propagation private`: a private /sys/fs/cgroup with the v1 hierarchies
# only (controllers that share a hierarchy are mounted together, as the kernel requires), then podman.
CGROUP_V1 = r"""
set -e
mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup
awk 'NR > 1 && $4 == 1 { print $1, $2 }' /proc/cgroups | sort -k2 -n | awk '
  { if ($2 == 0) print $1; else groups[$2] = (groups[$2] ? groups[$2] "," : "") $1 }
  END { for (h in groups) print groups[h] }' | while read -r opts; do
    mkdir -p "/sys/fs/cgroup/$opts"
    mount -t cgroup -o "$opts" cgroup "/sys/fs/cgroup/$opts"
    case "$opts" in *,*) for c in $(echo "$opts" | tr , ' '); do ln -sfn "$opts" "/sys/fs/cgroup/$c"; done;; esac
done
mkdir -p /sys/fs/cgroup/systemd
mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd
exec "$@"
"""


def needs_private_cgroups() -> bool:
    """True on a hybrid/v1 host whose /sys/fs/cgroup is a tmpfs (this VM); False on a pure cgroup v2 host."""
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 2 and fields[1] == "/sys/fs/cgroup":
                return fields[2] == "tmpfs"
    return False


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "podman kube play in these tests runs as root"
    if shutil.which("podman") is None:
        return "podman is not installed: `apt-get install -y podman` (make test installs it)"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is missing"
    return None


class Podman:
    def __init__(self, root: Path = ROOT, runroot: Path = RUNROOT) -> None:
        self.root, self.runroot = root, runroot
        self.conf = root / "containers.conf"

    def prepare(self) -> Podman:
        self.root.mkdir(parents=True, exist_ok=True)
        def hard(limit: int, most: int) -> int:
            value = resource.getrlimit(limit)[1]
            return most if value == resource.RLIM_INFINITY else min(value, most)

        self.conf.write_text(CONTAINERS_CONF.format(nofile=hard(resource.RLIMIT_NOFILE, 65536),
                                                    nproc=hard(resource.RLIMIT_NPROC, 32768)))
        return self

    @property
    def command(self) -> list[str]:
        """podman on this storage (what ``prefix`` runs; an image build needs no cgroups)."""
        return ["podman", "--root", str(self.root / "storage"), "--runroot", str(self.runroot),
                "--tmpdir", str(self.runroot / "tmp")]

    @property
    def prefix(self) -> list[str]:
        if needs_private_cgroups():
            return ["unshare", "--mount", "--propagation", "private", "sh", "-c", CGROUP_V1, "sh", *self.command]
        return self.command

    def run(self, *args: str, check: bool = True, timeout: float = 120,
            input: bytes | None = None) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "CONTAINERS_CONF": str(self.conf)}
        proc = subprocess.run([*self.prefix, *args], capture_output=True, timeout=timeout, env=env, check=False,
                              input=input)
        result = subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode("utf-8", "replace"),
                                             proc.stderr.decode("utf-8", "replace"))
        if check and result.returncode != 0:
            raise RuntimeError(f"podman {' '.join(args[:3])} failed ({result.returncode}): {result.stderr[-2000:]}")
        return result

    # -- images ----------------------------------------------------------------------------------
    def has_image(self, name: str) -> bool:
        return self.run("image", "exists", name, check=False).returncode == 0

    def import_skeleton(self, name: str = SKELETON) -> str:
        """A root file system of a few KB: merged-/usr symlinks, /etc basics, empty mount points. Cached."""
        if self.has_image(name):
            return name
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            def add_dir(path: str, mode: int = 0o755) -> None:
                info = tarfile.TarInfo(path)
                info.type, info.mode = tarfile.DIRTYPE, mode
                tar.addfile(info)

            def add_link(path: str, target: str) -> None:
                info = tarfile.TarInfo(path)
                info.type, info.linkname = tarfile.SYMTYPE, target
                tar.addfile(info)

            for d in ("usr", "etc", "proc", "sys", "dev", "root", "run", "var", "var/run", "var/tmp", "home", "opt",
                      "work", "model"):
                add_dir(d)
            add_dir("tmp", 0o1777)
            for link, target in (("bin", "usr/bin"), ("sbin", "usr/sbin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")):
                add_link(link, target)
            for f in ("passwd", "group", "nsswitch.conf", "hosts", "ld.so.cache", "ld.so.conf"):
                src = Path("/etc") / f
                if src.is_file():
                    data = src.read_bytes()
                    info = tarfile.TarInfo(f"etc/{f}")
                    info.size, info.mode = len(data), 0o644
                    tar.addfile(info, io.BytesIO(data))
        self.run("import", "--change", "CMD=[\"/bin/sh\"]", "--change",
                 "ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "-", name,
                 input=buf.getvalue(), timeout=300)
        return name

    def build_image(self, tag: str, *, cache: Path = IMAGE_CACHE, timeout: float = 1200) -> str:
        """``deploy/image/build.sh`` (what ``make image`` runs) into this storage; the image ID. It installs
        mmdebstrap and podman when they are missing."""
        env = {**os.environ, "CONTAINERS_CONF": str(self.conf), "IMAGE": tag, "PODMAN": " ".join(self.command),
               "PYTHON": sys.executable, "CACHE": str(cache)}
        proc = subprocess.run([str(REPO / "deploy" / "image" / "build.sh")], capture_output=True, text=True,
                              timeout=timeout, env=env, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"deploy/image/build.sh failed ({proc.returncode}): {proc.stderr[-3000:]}")
        return proc.stdout.split()[-1]

    def agent_image(self) -> str:
        """The agent's image built from this tree (``build_image``), once per state of its inputs."""
        tag = f"{AGENT_IMAGE}:test-{image_inputs()[:16]}"
        if not self.has_image(tag):
            self.forget_images(f"{AGENT_IMAGE}:test-")  # earlier states of the tree
            self.build_image(tag)
        return tag

    def forget_images(self, prefix: str) -> None:
        """Remove the tags that start with ``prefix``, then the images no tag names any more."""
        names = self.run("images", "--format", "{{.Repository}}:{{.Tag}}", check=False).stdout.split()
        old = [n for n in names if n.startswith(prefix)]
        if old:
            self.run("rmi", "--force", *old, check=False, timeout=300)
        self.run("image", "prune", "--force", check=False, timeout=300)

    # -- pods --------------------------------------------------------------------------------------
    def kube_play(self, yaml_file: Path, *, timeout: float = 300) -> str:
        return self.run("kube", "play", "--network", "none", str(yaml_file), timeout=timeout).stdout

    def kube_down(self, yaml_file: Path) -> None:
        self.run("kube", "down", str(yaml_file), check=False, timeout=180)

    def remove_pod(self, name: str, *, stop_seconds: int = 60) -> None:
        self.run("pod", "rm", "-f", "-t", str(stop_seconds), name, check=False, timeout=stop_seconds + 120)

    def exec(self, container: str, argv: Sequence[str], *, timeout: float = 60, check: bool = True,
             input: bytes | None = None) -> subprocess.CompletedProcess[str]:
        flags = ["-i"] if input is not None else []
        return self.run("exec", *flags, container, *argv, check=check, timeout=timeout, input=input)

    def logs(self, container: str, tail: int = 60) -> str:
        result = self.run("logs", "--tail", str(tail), container, check=False, timeout=60)
        return result.stdout + result.stderr

    def inspect(self, container: str) -> dict[str, Any]:
        out = self.run("container", "inspect", container, check=False, timeout=60)
        with contextlib.suppress(ValueError, IndexError):
            return dict(json.loads(out.stdout)[0])
        return {}

    def containers(self, pod: str) -> list[str]:
        out = self.run("ps", "-a", "--filter", f"pod={pod}", "--format", "{{.Names}}", check=False)
        return out.stdout.split()

    def wait(self, predicate: Any, timeout: float, what: str, *, poll: float = 2.0, detail: Any = None) -> Any:
        return waiting.wait_for(predicate, timeout, what, poll=poll, detail=detail)


# --- the example pool, as a pod podman can play -------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy" / "kubernetes" / "example"
CHART = REPO / "deploy" / "helm" / "vllm-tuner"
STATE_DIR = "/var/run/vllm-tuner"
ZIPAPP_DIR = "/opt/vllm-tuner"  # where the agent's image keeps launcher.pyz (a hostPath here)
API_DIR = "/var/run/vllm-tuner-api"  # the fake API server's state and the agent's token (a hostPath here)
API_PORT = 6443
POD_NAME = "vllm-pod-0"
NAMESPACE = "default"

def image_inputs() -> str:
    """A digest of everything the agent's image is made of in this tree."""
    digest = hashlib.sha256()
    paths = [REPO / "pyproject.toml", REPO / "README.md", REPO / "Containerfile",
             *sorted((REPO / "deploy" / "image").iterdir()), *sorted((REPO / "tuner").rglob("*"))]
    for path in paths:
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def kubectl() -> str:
    import sys

    candidate = Path(sys.executable).parent / "kubectl"
    return str(candidate) if candidate.exists() else "kubectl"


def render_example(*, wait: float = 30.0) -> list[dict[str, Any]]:
    """``kubectl kustomize deploy/kubernetes/example | vllm-tuner inject``, as documents; ``wait``: how long
    the engine waits for the agent before it starts on its own (``inject --wait``)."""
    import sys

    import yaml

    out = subprocess.run([kubectl(), "kustomize", str(EXAMPLE)], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    out = subprocess.run([sys.executable, "-m", "tuner", "inject", "--require", "--image", "vllm-tuner:test",
                          "--wait", f"{wait:g}"], input=out, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def chart_docs() -> list[dict[str, Any]]:
    """The Helm chart, rendered (its Role, Lease, ConfigMaps…)."""
    import helm_python
    import yaml

    with helm_python.Chart.load(str(CHART)) as chart:
        rendered = chart.render({"pool": {"name": "vllm"}, "serviceAccount": {"name": "vllm"}}, name="tuner",
                                namespace=NAMESPACE)
    return [d for name, text in sorted(rendered.items()) if name.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def chart_configmap() -> dict[str, Any]:
    """The Helm chart's ConfigMap (what the component mounts at /etc/vllm-tuner), pointed at the API server
    inside the pod, with the live knobs on (the engine's plugin, where its Python has it: .venv-vllm)."""
    import yaml

    (cm,) = [d for d in chart_docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "vllm-tuner-config-vllm"]
    cfg = yaml.safe_load(cm["data"]["config.yaml"])
    cfg["kubernetes"].update(api_server=f"http://127.0.0.1:{API_PORT}", token_file=f"{API_DIR}/token", ca_file=None,
                             retry_period_seconds=1, renew_deadline_seconds=4, lease_duration_seconds=6)
    cfg["scrape"] = {"interval_seconds": 5}
    cfg["live"] = {"enabled": True}
    cm["data"]["config.yaml"] = yaml.safe_dump(cfg, sort_keys=False)
    return cm


def write_api_state(api_dir: Path, *, labels: dict[str, str]) -> Path:
    """What the in-pod API server starts with: the chart's Role, Lease and journal ConfigMap, this pod's object
    (its IP is the pod's loopback: the pod has no other), and the agent's token."""
    from tests.support import fake_kube

    docs = chart_docs()
    (role,) = [d for d in docs if d["kind"] == "Role"]
    objects = [d for d in docs if d["kind"] == "Lease" or (d["kind"] == "ConfigMap" and "journal" in d["metadata"]["name"])]
    objects.append({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": POD_NAME, "labels": labels},
                    "spec": {"containers": [{"name": "vllm"}]},
                    "status": {"phase": "Running", "podIP": "127.0.0.1",
                               "conditions": [{"type": "Ready", "status": "True"}]}})
    api_dir.mkdir(parents=True, exist_ok=True)
    (api_dir / "token").write_text(fake_kube.AGENT_TOKEN)
    (api_dir / "state.json").write_text(json.dumps({"role_rules": role["rules"], "objects": objects}))
    return api_dir


def host_path(name: str, path: Path | str, mount: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    p = str(path)
    return ({"name": name, "hostPath": {"path": p, "type": "Directory"}},
            {"name": name, "mountPath": mount or p, "readOnly": True})


def playable_overlay(docs: list[dict[str, Any]], *, image: str, engine: Sequence[str], env: dict[str, str],
                 zipapp_dir: Path, host_dirs: Sequence[Path], api_dir: Path, prepare_init: bool = True,
                 config: str | None = "chart", state_dir: Path | None = None,
                 agent_image: str | None = None) -> tuple[list[dict[str, Any]], str]:
    """The example pool, made playable here (the rendered example is changed only where this machine
    needs it): one replica; ``engine`` (an argv) instead of the example's model command, after the
    component's launcher prefix; the skeleton image with the host's /usr and ``host_dirs`` as read-only
    hostPath volumes; no GPU; no service-account token (the API server is the fake one, in the pod: module
    docstring); and the native sidecar as an init container (the real agent's start-up, ``--prepare-only``)
    plus an ordinary container (the real agent); no ports or probes (below). ``prepare_init=False``: no
    such init container, the agent alongside the engine (a native sidecar without a startupProbe, as
    `vllm-tuner inject` makes it, when the agent cannot prepare anything). ``config``: ``"chart"``, the
    chart's ConfigMap; None, no ConfigMap at all (the pod's volume is optional); any other text, that
    config.yaml. ``state_dir``: a fresh host directory as the shared state volume instead of the
    emptyDir (podman 4.3 plays an emptyDir as a *named* volume, ``vllm-tuner-state``, kept and shared
    by every pod it plays: an earlier pod's launcher.pyz and desired.json would still be there), mode
    0777 as the kubelet makes an emptyDir. ``agent_image``: the agent runs in that image (``make image``)
    as its own user (65532:0) with the securityContext ``inject`` gave it, the engine as root: two uids;
    else the agent runs the project's virtualenv from the host, as root.
    Returns the documents and the base argv's sha256."""
    import copy

    from tuner.portable import argv as argvs

    docs = copy.deepcopy(docs)
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    deployment["spec"]["replicas"] = 1
    spec = deployment["spec"]["template"]["spec"]
    engine_c = spec["containers"][0]
    prefix = engine_c["command"][: engine_c["command"].index("--") + 1]
    engine_c["command"] = [*prefix, *engine]
    engine_c["image"] = image
    engine_c.pop("resources", None)
    engine_c["env"] = [{"name": k, "value": v} for k, v in env.items()]
    base_sha256 = argvs.sha256(engine)

    mounts: list[dict[str, Any]] = []
    for i, d in enumerate([Path("/usr"), *host_dirs]):
        volume, mount = host_path(f"host-{i}", d)
        spec["volumes"].append(volume)
        mounts.append(mount)
    zip_volume, zip_mount = host_path("launcher-zipapp", zipapp_dir, ZIPAPP_DIR)
    spec["volumes"].append(zip_volume)
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "vllm-tuner-token"]
    engine_c["volumeMounts"] += mounts

    (sidecar,) = spec["initContainers"]
    sidecar.pop("restartPolicy")
    sidecar.pop("startupProbe", None)
    api_volume, api_mount = host_path("vllm-tuner-api", api_dir, API_DIR)
    spec["volumes"].append(api_volume)
    repo_volume, repo_mount = host_path("vllm-tuner-repo", REPO)
    spec["volumes"].append(repo_volume)
    own_mounts = [m for m in sidecar["volumeMounts"] if m["name"] != "vllm-tuner-token"]
    if agent_image is not None:
        # The image as `make image` built it: its entrypoint, its user, its launcher.pyz; nothing from the host
        # but the fake API server's token.
        sidecar["image"] = agent_image
        sidecar["volumeMounts"] = [*own_mounts, api_mount]
    else:
        sidecar.pop("securityContext", None)  # the image's non-root user cannot read the hostPath repository here
        sidecar["image"] = image
        pyenv = Path(os.path.realpath(REPO / ".venv" / "bin" / "python")).parents[2]  # the Python the venv links to
        pyenv_volume, pyenv_mount = host_path("vllm-tuner-python", pyenv)
        spec["volumes"].append(pyenv_volume)
        sidecar["volumeMounts"] = _unique_mounts(own_mounts + mounts + [api_mount, repo_mount, pyenv_mount])
        # The image's entrypoint is `vllm-tuner`; here it is the project's virtualenv.
        sidecar["command"] = [str(REPO / ".venv" / "bin" / "python"), "-m", "tuner"]
        sidecar["env"] = [*sidecar.get("env", []), {"name": "PYTHONUNBUFFERED", "value": "1"},
                          {"name": "HOME", "value": "/tmp"}]
    init = {**copy.deepcopy(sidecar), "name": "vllm-tuner-agent-init",
            "args": [*sidecar["args"], "--prepare-only", "--startup-timeout", "3"]}
    init.pop("ports", None)
    if agent_image is None:
        init["volumeMounts"] = [*init["volumeMounts"], zip_mount]
    agent = sidecar
    api = {"name": "kube-api", "image": image,
           "command": ["python3", str(REPO / "tests" / "support" / "fake_kube.py"), "--port", str(API_PORT),
                       "--state", f"{API_DIR}/state.json", "--namespace", NAMESPACE],
           "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
           "volumeMounts": _unique_mounts([*mounts, api_mount, repo_mount])}
    spec["initContainers"] = [init] if prepare_init else []
    # podman 4.3 removes a finished "once" init container and sometimes races its exit ("cannot remove
    # container ... as it is running"); "always" keeps it (exited) instead. podman applies the pod's
    # restartPolicy to init containers too: with Always it reran the agent's start-up every few seconds
    # (rewriting desired.json), so OnFailure here; the test is about relaunching without restarts.
    for meta in (deployment["metadata"], deployment["spec"]["template"]["metadata"]):
        meta.setdefault("annotations", {})["io.podman.annotations.init.container.type"] = "always"
    spec["restartPolicy"] = "OnFailure"
    spec["containers"].extend([agent, api])
    for container in [*spec["containers"], *spec["initContainers"]]:
        # --network none has no port mappings; podman 4.3 runs httpGet probes with curl inside the
        # container (not in this image) and ignores readiness: the test probes /livez and /readyz itself.
        for key in ("ports", "livenessProbe", "readinessProbe", "startupProbe"):
            container.pop(key, None)
        # podman 4.3 has no downward API for metadata.namespace/uid: plain values stand in.
        for var in container.get("env", []):
            field = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            if field is not None:
                var.pop("valueFrom")
                var["value"] = {"metadata.name": POD_NAME, "metadata.namespace": NAMESPACE}.get(field, "podman")
    if state_dir is not None:
        state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(state_dir, 0o777)
        spec["volumes"] = [{"name": "vllm-tuner-state", "hostPath": {"path": str(state_dir), "type": "Directory"}}
                           if v["name"] == "vllm-tuner-state" else v for v in spec["volumes"]]
    if config is None:
        return [deployment], base_sha256
    cm = chart_configmap()
    if config != "chart":
        cm["data"] = {"config.yaml": config}
    return [deployment, cm], base_sha256


def _unique_mounts(mounts: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    seen: set[str] = set()
    out = []
    for m in mounts:
        if m["mountPath"] not in seen:
            seen.add(m["mountPath"])
            out.append(m)
    return out


def write_yaml(path: Path, docs: Sequence[dict[str, Any]]) -> Path:
    """Multi-line strings as literal blocks (podman's YAML reader refused PyYAML's folded quoted ones):
    the dump ``vllm-tuner inject`` writes."""
    from tuner.cli.injecting import dump_all

    path.write_text(dump_all(list(docs)))
    return path


PROBE = """\
import sys, urllib.request, urllib.error
req = urllib.request.Request(sys.argv[1], data=sys.argv[2].encode() if len(sys.argv) > 2 else None,
                             headers={"Content-Type": "application/json"})
try:
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=float(sys.argv[3]) if len(sys.argv) > 3 else 30) as r:
        print(r.status); print(r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code); print(e.read().decode())
except OSError as e:
    print(0); print(repr(e))
"""


class PlayedPod:
    """The example pool's pod under ``podman kube play``; everything is looked at from inside the pod
    (its own loopback: --network none), through ``podman exec`` in the agent's container."""

    def __init__(self, podman: Podman, yaml_file: Path, *, name: str = "vllm-pod-0") -> None:
        self.podman, self.yaml_file, self.name = podman, yaml_file, name
        self.engine = f"{name}-vllm"
        self.agent = f"{name}-vllm-tuner-agent"

    def play(self) -> PlayedPod:
        self.podman.remove_pod(self.name, stop_seconds=10)  # a leftover of an interrupted run
        self.podman.kube_play(self.yaml_file)
        return self

    def down(self) -> None:
        self.podman.kube_down(self.yaml_file)
        self.podman.remove_pod(self.name, stop_seconds=60)

    def status(self) -> dict[str, Any]:
        out = self.podman.exec(self.agent, ["cat", f"{STATE_DIR}/status.json"], check=False)
        with contextlib.suppress(ValueError):
            return dict(json.loads(out.stdout))
        return {}

    def http(self, url: str, body: dict[str, Any] | None = None, *, timeout: float = 60) -> tuple[int, str]:
        """A request from inside the pod (the agent's container): (status, body); status 0: no answer."""
        argv = ["python3", "-c", PROBE, url] + ([json.dumps(body), str(timeout)] if body is not None else [])
        out = self.podman.exec(self.agent, argv, timeout=timeout + 30, check=False).stdout
        code, _, text = out.partition("\n")
        return (int(code) if code.strip().isdigit() else 0), text

    def restart_count(self, container: str) -> int:
        return int(self.podman.inspect(container).get("RestartCount", 0))

    def wait_status(self, predicate: Any, timeout: float, what: str) -> dict[str, Any]:
        return dict(self.podman.wait(lambda: (lambda st: st if st and predicate(st) else None)(self.status()),
                                     timeout, what, poll=2.0, detail=lambda: self.podman.logs(self.engine, 40)))


API_CALL = """\
import json, sys, urllib.request, urllib.error
method, path = sys.argv[1], sys.argv[2]
body = sys.argv[3].encode() if len(sys.argv) > 3 else None
req = urllib.request.Request("http://127.0.0.1:%d" + path, data=body, method=method,
                             headers={"Authorization": "Bearer %s", "Content-Type": "application/merge-patch+json"})
try:
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=30) as r:
        print(r.status); print(r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code); print(e.read().decode())
except OSError as e:
    print(0); print(repr(e))
"""


class ApiLeader:
    """The leader's side of one pod, done by hand through the API server in the pod: the pod's desired state
    written into the pool's ConfigMap (as the leader's actuator does), the pod's real agent carrying it out
    (desired.json for its launcher) and reporting back into the ConfigMap."""

    JOURNAL = "/api/v1/namespaces/default/configmaps/vllm-tuner-journal-vllm"

    def __init__(self, pod: PlayedPod, *, base_sha256: str) -> None:
        from tests.support import fake_kube

        self.pod, self.base_sha256, self.serial = pod, base_sha256, 0
        self.entry: dict[str, Any] = {}  # the pod's desired state as last written
        self.script = API_CALL % (API_PORT, fake_kube.ADMIN_TOKEN)

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        argv = ["python3", "-c", self.script, method, path] + ([json.dumps(body)] if body is not None else [])
        out = self.pod.podman.exec(self.pod.agent, argv, timeout=90, check=False).stdout
        code, _, text = out.partition("\n")
        with contextlib.suppress(ValueError):
            return int(code), json.loads(text)
        return 0, text

    def data(self) -> dict[str, str]:
        code, cm = self.call("GET", self.JOURNAL)
        return dict(cm.get("data") or {}) if code == 200 else {}

    def report(self) -> dict[str, Any]:
        text = self.data().get(f"report.{POD_NAME}")
        return dict(json.loads(text)) if text else {}

    def desired_file(self) -> dict[str, Any]:
        out = self.pod.podman.exec(self.pod.agent, ["cat", f"{STATE_DIR}/desired.json"], check=False).stdout
        with contextlib.suppress(ValueError):
            return dict(json.loads(out))
        return {}

    def request(self, overrides: Sequence[tuple[str, str]], *, drain: bool = False, timeout: float = 120) -> int:
        """The desired state for the pod; returns the desired.json generation its agent wrote for it."""
        self.serial += 1
        entry = {"serial": self.serial, "overrides": [list(o) for o in overrides], "base_sha256": self.base_sha256,
                 "drain": drain}
        self._write(entry)
        desired = self.pod.podman.wait(lambda: (lambda d: d if d.get("serial") == self.serial else None)(
            self.desired_file()), timeout, f"the agent to carry out request {self.serial}", poll=1.0,
            detail=lambda: self.pod.podman.logs(self.pod.agent, 40))
        return int(desired["generation"])

    def request_live(self, seq: int, values: dict[str, int | None]) -> None:
        """A live request for the pod's engine-side plugin, as the leader's ``acting.RelayedPlugin`` writes it:
        ``desired[pod].live`` (no new serial: nothing is relaunched)."""
        self._write({**self.entry, "live": {"seq": seq, "values": values}})

    def _write(self, entry: dict[str, Any]) -> None:
        code, answer = self.call("PATCH", self.JOURNAL, {"data": {"desired": json.dumps({POD_NAME: entry})}})
        assert code == 200, (code, answer)
        self.entry = entry
