#!/usr/bin/env python3
"""Record NVML on a real GPU while it goes idle → bf16 matmul load → idle, for tests/fixtures/nvml/.

    python3 -m bench.record_nvml OUT.json [--gpu 0] [--idle 8] [--load 45] [--cool 7]

Needs only pynvml and torch (no tuner dependencies): it drives ``tuner.sources.nvml.NvmlSource`` through a
recording proxy of pynvml, so every sample holds (a) the raw answer of every NVML call NvmlSource made,
keyed like harness/fake_nvml.py's call keys, and (b) the GpuReading NvmlSource built from them. The
fake replays (a); tests/unit/test_nvml_source.py checks that the replay rebuilds (b) exactly.

Read-only: it never changes a GPU setting (no clocks, power limits, persistence mode, resets).
``--dry-run`` replays nothing: it runs against harness/fake_nvml.py with no GPU and no torch.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import importlib
import json
import math
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

from tuner.model.gpus import reason_names
from tuner.sources.nvml import NvmlSource


def call_key(fn: str, *args: Any) -> str:  # same convention as harness/fake_nvml.py
    parts = [",".join(map(str, a)) if isinstance(a, list | tuple) else str(a) for a in args]
    return ":".join([fn, *parts])


_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def jsonable(v: Any) -> Any:
    if v is None or isinstance(v, bool | int | str):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else repr(v)
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    if isinstance(v, list | tuple | ctypes.Array):
        return [jsonable(x) for x in v]
    if hasattr(v, "nvmlReturn") and hasattr(v, "valueType"):  # c_nvmlFieldValue_t
        member = _VALUE_MEMBERS.get(v.valueType, "uiVal")
        return {
            "fieldId": v.fieldId,
            "scopeId": v.scopeId,
            "nvmlReturn": v.nvmlReturn,
            "valueType": v.valueType,
            "value": jsonable(getattr(v.value, member)),
        }
    if isinstance(v, ctypes.Structure | ctypes.Union):
        return {f[0]: jsonable(getattr(v, f[0])) for f in v._fields_}
    if isinstance(v, types.SimpleNamespace):
        return {k: jsonable(x) for k, x in vars(v).items()}
    return repr(v)


@dataclasses.dataclass(frozen=True)
class _Handle:
    index: int
    real: Any


class RecordingNvml(types.ModuleType):
    """Passes every ``nvml*`` call to the real module and keeps its answer in ``log[scope][key]``."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__("pynvml_recording")
        self._real = real
        self.log: dict[str, dict[str, Any]] = {}

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._real, name)
        if name.startswith("nvml") and callable(value):
            return functools.partial(self._call, name, value)
        return value

    def _call(self, name: str, fn: Any, *args: Any) -> Any:
        scope, real_args, key_args = "global", [], []
        for a in args:
            if isinstance(a, _Handle):
                scope = str(a.index)
                real_args.append(a.real)
            else:
                real_args.append(a)
                key_args.append(a)
        key = call_key(name, *key_args)
        entries = self.log.setdefault(scope, {})
        try:
            ret = fn(*real_args)
        except Exception as exc:
            code = getattr(exc, "value", None)
            entries[key] = {"err": code if isinstance(code, int) else type(exc).__name__}
            raise
        if name.startswith("nvmlDeviceGetHandleBy"):
            entries[key] = {"ret": "<handle>"}
            return _Handle(int(args[0]), ret)
        entries[key] = {"ret": jsonable(ret)}
        return ret


def safe(fn: Any, *args: Any) -> Any:
    try:
        return jsonable(fn(*args))
    except Exception as exc:
        return {"err": getattr(exc, "value", type(exc).__name__), "exc": type(exc).__name__}


def static_info(nvml: types.ModuleType, index: int) -> dict[str, Any]:
    """Read-only extras NvmlSource does not ask for, to document the board."""
    h = nvml.nvmlDeviceGetHandleByIndex(index)
    supported = safe(getattr(nvml, "nvmlDeviceGetSupportedClocksEventReasons", None) or (lambda _h: None), h)
    if not isinstance(supported, int):
        supported = safe(nvml.nvmlDeviceGetSupportedClocksThrottleReasons, h)
    thresholds = {
        name: safe(
            nvml.nvmlDeviceGetTemperatureThreshold, h, getattr(nvml, f"NVML_TEMPERATURE_THRESHOLD_{name}", i)
        )
        for i, name in enumerate(["SHUTDOWN", "SLOWDOWN", "MEM_MAX", "GPU_MAX"])
    }
    return {
        "name": safe(nvml.nvmlDeviceGetName, h),
        "supported_clocks_event_reasons": supported,
        "supported_names": reason_names(supported) if isinstance(supported, int) else None,
        "thresholds_c": thresholds,
        "power_limit_constraints_mw": safe(nvml.nvmlDeviceGetPowerManagementLimitConstraints, h),
        "power_default_limit_mw": safe(nvml.nvmlDeviceGetPowerManagementDefaultLimit, h),
        "power_management_limit_mw": safe(nvml.nvmlDeviceGetPowerManagementLimit, h),
        "max_clocks_mhz": {
            "sm": safe(nvml.nvmlDeviceGetMaxClockInfo, h, 1),
            "graphics": safe(nvml.nvmlDeviceGetMaxClockInfo, h, 0),
            "mem": safe(nvml.nvmlDeviceGetMaxClockInfo, h, 2),
        },
        "mem_clock_mhz": safe(nvml.nvmlDeviceGetClockInfo, h, 2),
        "persistence_mode": safe(nvml.nvmlDeviceGetPersistenceMode, h),
    }


def violations(nvml: types.ModuleType, index: int) -> dict[str, Any]:
    h = nvml.nvmlDeviceGetHandleByIndex(index)
    return {
        name: safe(nvml.nvmlDeviceGetViolationStatus, h, policy)
        for name, policy in (("power", 0), ("thermal", 1), ("sync_boost", 2), ("board_limit", 3))
    }


class MatmulLoad(threading.Thread):
    def __init__(self, gpu: int, n: int) -> None:
        super().__init__(daemon=True)
        import torch

        self.torch = torch
        self.device = torch.device("cuda", gpu)
        self.a = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
        self.b = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
        (self.a @ self.b).sum().item()  # create the context and cuBLAS handles before the idle phase
        self.n = n
        self.go = threading.Event()
        self.stop = threading.Event()
        self.iterations = 0
        self.seconds = 0.0

    def run(self) -> None:
        self.go.wait()
        torch = self.torch
        start = time.perf_counter()
        while not self.stop.is_set():
            for _ in range(20):
                _ = self.a @ self.b
            torch.cuda.synchronize(self.device)
            self.iterations += 20
        self.seconds = time.perf_counter() - start

    def tflops(self) -> float:
        return 2 * self.n**3 * self.iterations / max(self.seconds, 1e-9) / 1e12


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--idle", type=float, default=8.0)
    ap.add_argument("--load", type=float, default=45.0)
    ap.add_argument("--cool", type=float, default=7.0)
    ap.add_argument("--interval", type=float, default=0.75)
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--dry-run", action="store_true", help="use harness/fake_nvml.py, no GPU, no torch")
    args = ap.parse_args()

    if args.dry_run:
        from harness.fake_nvml import FakeNvml

        real: types.ModuleType = FakeNvml()
    else:
        real = importlib.import_module("pynvml")
    proxy = RecordingNvml(real)
    last_t = [0.0]

    def clock() -> float:
        last_t[0] = time.time()
        return last_t[0]

    source = NvmlSource([args.gpu], nvml=proxy, clock=clock)
    samples: list[dict[str, Any]] = []

    def sample(phase: str) -> None:
        proxy.log = {}
        readings = source.read()
        samples.append(
            {
                "t": last_t[0],
                "phase": phase,
                "calls": proxy.log,
                "readings": [dataclasses.asdict(r) for r in readings],
            }
        )

    sample("init")  # initialises NVML through the proxy, so nvmlInit/handles are recorded too
    if source.unavailable_reason:
        print("NVML unavailable:", source.unavailable_reason, file=sys.stderr)
        return 2

    meta: dict[str, Any] = {
        "script": "bench/record_nvml.py",
        "call_key_format": "fn[:arg...] (handle args dropped; list args joined by ','); scope = GPU index",
        "gpu": args.gpu,
        "device_count": args.gpu + 1,  # the replay fake needs indices 0..gpu to exist
        "driver_version": safe(getattr(real, "nvmlSystemGetDriverVersion", None) or (lambda: None)),
        "nvml_version": safe(getattr(real, "nvmlSystemGetNVMLVersion", None) or (lambda: None)),
        "cuda_driver_version": safe(getattr(real, "nvmlSystemGetCudaDriverVersion", None) or (lambda: None)),
        "system_device_count": safe(real.nvmlDeviceGetCount),
        "python": sys.version.split()[0],
        "interval_s": args.interval,
    }
    try:
        from importlib.metadata import version

        meta["nvidia_ml_py"] = version("nvidia-ml-py")
    except ImportError as exc:
        meta["nvidia_ml_py"] = repr(exc)
    if not args.dry_run:
        meta["static"] = static_info(real, args.gpu)
        meta["violations_start_ns"] = violations(real, args.gpu)

    load: MatmulLoad | None = None
    if not args.dry_run:
        load = MatmulLoad(args.gpu, args.size)
        meta["torch"] = load.torch.__version__
        load.start()

    phases = [("idle", args.idle), ("load", args.load), ("cool", args.cool)]
    meta["phases"] = []
    for phase, seconds in phases:
        if phase == "load" and load is not None:
            load.go.set()
        if phase == "cool" and load is not None:
            load.stop.set()
            load.join()
        start = time.time()
        meta["phases"].append({"name": phase, "start": start})
        while time.time() - start < seconds:
            t0 = time.monotonic()
            sample(phase)
            time.sleep(max(0.0, args.interval - (time.monotonic() - t0)))
        meta["phases"][-1]["end"] = time.time()

    if load is not None:
        meta["matmul"] = {
            "n": load.n,
            "iterations": load.iterations,
            "seconds": load.seconds,
            "tflops": round(load.tflops(), 1),
        }
        meta["violations_end_ns"] = violations(real, args.gpu)
    source.close()

    lines = ",\n".join(json.dumps(s, separators=(",", ":")) for s in samples)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text('{"meta":' + json.dumps(meta, indent=1) + ',\n"samples":[\n' + lines + "\n]}\n")

    # A short summary for the log.
    print(json.dumps({k: v for k, v in meta.items() if k not in ("phases",)}, indent=1))
    seen: dict[int, list[str]] = {}
    for s in samples:
        for r in s["readings"]:
            seen.setdefault(r["clocks_event_reasons"], []).append(s["phase"])
            print(
                f"{s['phase']:5} t={s['t'] - samples[0]['t']:6.1f} T={r['gpu_temp_c']} Tm={r['mem_temp_c']} "
                f"P={r['power_w']}/{r['power_limit_w']} sm={r['sm_clock_mhz']}/{r['sm_clock_max_mhz']} "
                f"util={r['gpu_util']} mem={r['mem_used_bytes']} reasons={r['clocks_event_reasons']} "
                f"err={r['error']}"
            )
    for mask, where in seen.items():
        names = reason_names(mask) if mask is not None else None
        print(
            f"mask {mask if mask is None else hex(mask)} {names}: {len(where)} samples in {sorted(set(where))}"
        )
    errs = {k for s in samples for c in s["calls"].values() for k, v in c.items() if "err" in v}
    print("calls that failed:", sorted(errs))
    print("bytes:", args.out.stat().st_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
