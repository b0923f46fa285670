#!/bin/sh
# Install vllm-tuner under systemd: its system user, units, polkit rule and configuration directory, and
# enable it. Run as root, from a checkout (make install-systemd runs it). What it writes:
#
#   /etc/sysusers.d/vllm-tuner.conf          the users vllm-tuner (the tuner) and vllm (the engines)
#   /etc/systemd/system/vllm-tuner.service   the tuner, unprivileged; state in /var/lib/vllm-tuner
#   /etc/systemd/system/vllm@.service        one engine replica per instance
#   /etc/systemd/system/*.service.d/10-install.conf   where vllm-tuner and vllm are on this host
#   /etc/polkit-1/rules.d/50-vllm-tuner.rules          vllm-tuner may start/stop/restart vllm@*.service only
#   /etc/vllm-tuner/config.yaml              root:vllm-tuner 0640, read-only for the tuner; kept if present
#
# Options:
#   --bin PATH      the vllm-tuner command (default: the one on PATH)
#   --vllm PATH     the vllm command the engine units run as `PATH serve $VLLM_ARGS` (default: the one on PATH)
#   --config FILE   install FILE as /etc/vllm-tuner/config.yaml (default: keep the present one, else an
#                   observe-mode example)
#   --nvml          also the drop-in that lets the sandboxed tuner read GPUs through NVML
#   --nginx         also the drop-in for drain: {kind: nginx} (CAP_KILL for `nginx -s reload`)
#   --no-start      enable the tuner, do not start it now
# Every step is idempotent: run it again after an upgrade.
set -eu

HERE=$(cd "$(dirname "$0")" && pwd)
BIN=""; VLLM=""; CONFIG=""; NVML=0; NGINX=0; START=1
die() { echo "error: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) [ $# -ge 2 ] || die "--bin needs a path, e.g. --bin /usr/local/bin/vllm-tuner"; BIN=$2; shift 2 ;;
    --vllm) [ $# -ge 2 ] || die "--vllm needs a path, e.g. --vllm /opt/vllm/bin/vllm"; VLLM=$2; shift 2 ;;
    --config) [ $# -ge 2 ] || die "--config needs a file, e.g. --config ./config.yaml"; CONFIG=$2; shift 2 ;;
    --nvml) NVML=1; shift ;;
    --nginx) NGINX=1; shift ;;
    --no-start) START=0; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

[ "$(id -u)" = 0 ] || die "run as root (sudo make install-systemd): it creates a system user and installs units"
[ -d /run/systemd/system ] || die "PID 1 is not systemd here (/run/systemd/system is missing)"
command -v systemd-sysusers >/dev/null || die "systemd-sysusers is missing (systemd ≥ 215)"
[ -n "$BIN" ] || BIN=$(command -v vllm-tuner || true)
[ -n "$BIN" ] || die "vllm-tuner is not on PATH: install it first (pipx install . or pip install .), or pass --bin PATH"
[ -x "$BIN" ] || die "$BIN is not an executable file (--bin)"
BIN=$(readlink -f "$BIN")
[ -n "$VLLM" ] || VLLM=$(command -v vllm || true)
if [ -n "$VLLM" ]; then
  [ -x "$VLLM" ] || die "$VLLM is not an executable file (--vllm)"
  VLLM=$(readlink -f "$VLLM")
else
  echo "warning: vllm is not on PATH: the engine units run /usr/local/bin/vllm until you pass --vllm PATH" >&2
fi
if [ -n "$CONFIG" ]; then
  [ -f "$CONFIG" ] || die "$CONFIG is not a file (--config)"
fi

step() { echo "== $*"; }

step "users: vllm-tuner, vllm (sysusers.d)"
install -D -m 0644 "$HERE/vllm-tuner.sysusers" /etc/sysusers.d/vllm-tuner.conf
systemd-sysusers /etc/sysusers.d/vllm-tuner.conf

step "units: vllm-tuner.service, vllm@.service"
install -D -m 0644 "$HERE/vllm-tuner.service" /etc/systemd/system/vllm-tuner.service
install -D -m 0644 "$HERE/vllm@.service" /etc/systemd/system/vllm@.service
install -d -m 0755 /etc/systemd/system/vllm-tuner.service.d /etc/systemd/system/vllm@.service.d
# The units name /usr/local/bin; a drop-in points them at where the commands are on this host. Quoted for
# systemd's ExecStart= parser (a path with a space stays one word).
printf '%s\n' "# Written by deploy/systemd/install.sh: where vllm-tuner is on this host." "[Service]" "ExecStart=" \
  "ExecStart=\"$BIN\" run --config /etc/vllm-tuner/config.yaml" \
  > /etc/systemd/system/vllm-tuner.service.d/10-install.conf
if [ -n "$VLLM" ]; then
  printf '%s\n' "# Written by deploy/systemd/install.sh: where vllm is on this host." "[Service]" "ExecStart=" \
    "ExecStart=\"$VLLM\" serve \$VLLM_ARGS" > /etc/systemd/system/vllm@.service.d/10-install.conf
fi
if [ "$NVML" = 1 ]; then
  install -m 0644 "$HERE/vllm-tuner.service.d/nvml.conf" /etc/systemd/system/vllm-tuner.service.d/nvml.conf
fi
if [ "$NGINX" = 1 ]; then
  install -m 0644 "$HERE/vllm-tuner.service.d/nginx.conf" /etc/systemd/system/vllm-tuner.service.d/nginx.conf
fi

step "polkit: vllm-tuner may manage vllm@*.service"
install -D -m 0644 "$HERE/vllm-tuner.rules" /etc/polkit-1/rules.d/50-vllm-tuner.rules
if [ ! -x /usr/lib/polkit-1/polkitd ] && [ ! -x /usr/libexec/polkitd ] && ! command -v pkcheck >/dev/null; then
  echo "warning: polkitd is not installed: the tuner (user vllm-tuner) cannot start or stop engines until it is" \
       "(apt-get install polkitd)" >&2
fi

step "configuration: /etc/vllm-tuner (read-only for the tuner)"
install -d -m 0750 -o root -g vllm-tuner /etc/vllm-tuner
if [ -n "$CONFIG" ]; then
  install -m 0640 -o root -g vllm-tuner "$CONFIG" /etc/vllm-tuner/config.yaml
elif [ ! -e /etc/vllm-tuner/config.yaml ]; then
  install -m 0640 -o root -g vllm-tuner "$HERE/config.example.yaml" /etc/vllm-tuner/config.yaml
fi
"$BIN" check-config /etc/vllm-tuner/config.yaml >/dev/null || \
  echo "warning: /etc/vllm-tuner/config.yaml does not pass check-config (above); fix it, then systemctl restart vllm-tuner" >&2

step "enable"
systemctl daemon-reload
if [ "$START" = 1 ]; then
  systemctl enable --now vllm-tuner.service
else
  systemctl enable vllm-tuner.service
fi
echo "installed. vllm-tuner status | vllm-tuner history | systemctl reload vllm-tuner | journalctl -u vllm-tuner"
