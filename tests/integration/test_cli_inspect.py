"""`vllm-tuner inspect` and `check-config` as a user runs them (subprocess, real recorded captures)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Scheduling (tests/conftest.py): one of the fast tier's longest files, started first on a worker of its own;
# its rank by measured length (--durations=0), 1 the longest.
START_FIRST = 15

ROOT = Path(__file__).resolve().parents[2]
QUEUE = ROOT / "tests" / "fixtures" / "vllm" / "queue-bound"


def run(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "tuner", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def raw(path: Path, name: str, **labels) -> float:
    """Sum of a series' values read straight from the exposition text (an independent reading)."""
    total = 0.0
    for line in path.read_text().splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_inspect_two_real_captures_as_json():
    a, b = QUEUE / "003.prom", QUEUE / "005.prom"
    span = 7.5
    out = json.loads(run("inspect", "--engine-metrics", str(a), "--engine-metrics", str(b),
                         "--window-seconds", str(span), "--format", "json").stdout)
    sig = out["signals"]
    assert sig["requests_waiting"] == raw(b, "vllm:num_requests_waiting")
    assert sig["requests_running"] == raw(b, "vllm:num_requests_running")
    assert sig["kv_cache_usage"] == pytest.approx(raw(b, "vllm:kv_cache_usage_perc"), abs=1e-6)
    dq = raw(b, "vllm:request_queue_time_seconds_sum") - raw(a, "vllm:request_queue_time_seconds_sum")
    dn = raw(b, "vllm:request_queue_time_seconds_count") - raw(a, "vllm:request_queue_time_seconds_count")
    assert dn > 0
    assert sig["queue_time_mean_s"] == pytest.approx(dq / dn, rel=1e-6)
    finished = raw(b, "vllm:request_success_total") - raw(a, "vllm:request_success_total")
    assert sig["request_rate"] == pytest.approx(finished / span, rel=1e-6)
    gen = raw(b, "vllm:generation_tokens_total") - raw(a, "vllm:generation_tokens_total")
    assert sig["generation_tokens_per_s"] == pytest.approx(gen / span, rel=1e-6)
    block = re.search(r'block_size="(\d+)"', b.read_text()).group(1)
    assert sig["block_size"] == int(block)
    # the queue-bound capture really is queue-bound
    assert sig["requests_running"] == 4 and sig["requests_waiting"] > 4
    # every null has a reason
    assert all(name in out["reasons"] for name, v in sig.items() if v is None)


def test_inspect_table_and_bad_inputs(tmp_path):
    html = tmp_path / "page.prom"
    html.write_text("<!DOCTYPE html><html><body>Sign in</body></html>\n")
    out = run("inspect", "--engine-metrics", str(QUEUE / "000.prom"), "--engine-metrics", str(html)).stdout
    assert "invalid scrape" in out
    assert "latest scrape failed" in out
    missing = run("inspect", "--engine-metrics", str(tmp_path / "nope.prom"), check=False)
    assert missing.returncode == 2
    assert "nope.prom" in missing.stderr


def test_counter_reset_in_the_restart_capture_gives_a_reason_not_a_negative_rate():
    restart = ROOT / "tests" / "fixtures" / "vllm" / "restart"
    out = json.loads(run("inspect", "--engine-metrics", str(restart / "001.prom"), "--engine-metrics",
                         str(restart / "002.prom"), "--format", "json").stdout)
    assert out["signals"]["generation_tokens_per_s"] is None
    assert "restart" in out["reasons"]["generation_tokens_per_s"]


def test_check_config_errors_name_file_field_and_expectation(tmp_path):
    cfg = tmp_path / "tuner.yaml"
    cfg.write_text("targets:\n  - name: a\n    metrics_url: localhost:8000/metrics\n    kind: vlm\n"
                   "scrape:\n  interval_seconds: 0\n")
    proc = run("check-config", str(cfg), check=False)
    assert proc.returncode == 2
    err = proc.stderr
    assert str(cfg) in err
    assert "targets[0].metrics_url" in err and "https?://" in err
    assert "targets[0].kind" in err and "'vllm' or 'sglang'" in err
    assert "scrape.interval_seconds" in err and "greater than 0" in err


def test_check_config_prints_the_effective_config_and_schema(tmp_path):
    cfg = tmp_path / "tuner.yaml"
    cfg.write_text("targets:\n  - name: a\n    metrics_url: http://127.0.0.1:8000/metrics\n")
    out = run("check-config", str(cfg)).stdout
    assert "interval_seconds: 2.0" in out
    schema = json.loads(run("config-schema").stdout)
    assert "targets" in schema["properties"]
    assert "dcgm-exporter" in json.dumps(schema)  # attribute docstrings became descriptions


def test_bad_yaml_names_the_line(tmp_path):
    cfg = tmp_path / "tuner.yaml"
    cfg.write_text("targets: [\n  - name: a\n")
    proc = run("check-config", str(cfg), check=False)
    assert proc.returncode == 2
    assert "line" in proc.stderr and "not valid YAML" in proc.stderr


def test_nvml_without_a_driver_says_so_once_and_goes_on():
    out = json.loads(run("inspect", "--engine-metrics", str(QUEUE / "000.prom"), "--nvml", "--format", "json").stdout)
    try:
        import pynvml

        pynvml.nvmlInit()
        pytest.skip("this machine has an NVIDIA driver")
    except Exception:
        pass
    assert out["signals"]["gpu_temp_c"] is None
    assert out["reasons"]["gpu_temp_c"].startswith("NVML unavailable")
    assert out["signals"]["requests_running"] is not None


def test_apply_mode_needs_an_actuator_and_engine_args(tmp_path):
    cfg = tmp_path / "tuner.yaml"
    cfg.write_text("mode: apply\ntargets: [{name: a, metrics_url: 'http://127.0.0.1:1/metrics'}]\n")
    proc = run("check-config", str(cfg), check=False)
    assert proc.returncode == 2
    assert "actuator: mode apply needs" in proc.stderr
    assert "targets[0].args" in proc.stderr


def test_a_single_replica_with_downtime_needs_maintenance_windows(tmp_path):
    cfg = tmp_path / "tuner.yaml"
    cfg.write_text("mode: apply\ntargets: [{name: a, metrics_url: 'http://127.0.0.1:1/metrics', args: []}]\n"
                   f"actuator: {{kind: process, command: [{sys.executable}], state_dir: {tmp_path / 'engines'}}}\n"
                   "rollout: {allow_downtime: true}\n")
    proc = run("check-config", str(cfg), check=False)
    assert proc.returncode == 2
    assert "daemon.maintenance_windows" in proc.stderr
    cfg.write_text(cfg.read_text() + "daemon: {maintenance_windows: ['* 3-4 * * *']}\n")
    assert run("check-config", str(cfg)).returncode == 0
