"""The rollout driver's words to the engines, through the one engine client: whether a replica serves and
how loaded it is (``Prober``), and its live knobs (``LiveControl``) on whatever path the engine offers.
``tuner.runtime.driving`` drives a rollout with them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tuner.actuators import base
from tuner.model import live
from tuner.rollout import machine
from tuner.sources import engines, live_knobs, live_paths


class Prober(Protocol):
    def is_healthy(self, replica: base.Replica) -> bool:
        """/health answers 200 and /v1/models lists a model."""

    def load(self, replica: base.Replica) -> int | None:
        """Requests running + waiting (from /metrics); None if the engine cannot be reached."""

    def warm(self, replica: base.Replica, *, requests: int) -> str | None:
        """Send ``requests`` small completions straight to the engine; None if all succeeded."""


class EngineProber:
    """``Prober`` over the engine client: the driver's only way to talk to the engines."""

    def __init__(self, client: engines.EngineClient, *, kind: str,
                 server_load: bool | Callable[[], bool] = False) -> None:
        """``server_load``: count what vLLM's HTTP server holds too (GET /load), where the engines track it;
        a function where that can change (the pods of a Kubernetes pool)."""
        self._client, self._kind, self._server_load = client, kind, server_load

    def is_healthy(self, replica: base.Replica) -> bool:
        return self._client.is_healthy(replica.base_url, self._kind)

    def load(self, replica: base.Replica) -> int | None:
        tracked = self._server_load() if callable(self._server_load) else self._server_load
        return self._client.load(replica.base_url, self._kind, server_load=tracked)

    def warm(self, replica: base.Replica, *, requests: int) -> str | None:
        return self._client.warm(replica.base_url, self._kind, requests=requests)


class LiveControl(Protocol):
    """A running engine's live knobs (machine Rule 5): ask for values, read whether they took."""

    def ask(self, replica: base.Replica, *, seq: int, values: machine.LiveValues) -> str | None:
        """Hand request ``seq`` over; None once handed over, else why not."""

    def answer(self, replica: base.Replica, *, seq: int, values: machine.LiveValues) -> tuple[bool, str | None]:
        """(every engine core runs ``values``, why request ``seq`` was refused or None)."""

    def poke(self, replica: base.Replica) -> None:
        """An idle engine runs no step, and a request is applied at the start of one: send one."""


class EngineLive:
    """``LiveControl`` over the engine client, whatever the live path the engine offers (its own API — vLLM's
    /trimtab or /v1/runtime_config, SGLang's /set_internal_state — else the plugin: ``plugin(name)``, the
    replica's control files or its pod's agent; None: the engine's own API only). Every path answers the same
    way: request ``seq`` is answered once the engine reports it (an engine API at once, the plugin at the next
    step), refused with the engine's reason, or taken when the values read back are the ones asked."""

    def __init__(self, client: engines.EngineClient, *, kind: str,
                 plugin: Callable[[str], live_knobs.Channel | None]) -> None:
        self._client, self._kind, self._plugin = client, kind, plugin

    def _state(self, replica: base.Replica) -> live.LiveState:
        return self._client.live_state(replica.base_url, self._plugin(replica.name), kind=self._kind)

    def ask(self, replica: base.Replica, *, seq: int, values: machine.LiveValues) -> str | None:
        return self._client.set_live(replica.base_url, self._plugin(replica.name), seq=seq, values=values,
                                     kind=self._kind)

    def answer(self, replica: base.Replica, *, seq: int, values: machine.LiveValues) -> tuple[bool, str | None]:
        st = self._state(replica)
        if st.seq != seq:
            return False, None  # not answered yet
        if st.refused:
            return False, st.refused
        return live_paths.mismatch(values, st) is None, None

    def poke(self, replica: base.Replica) -> None:
        self._client.warm(replica.base_url, self._kind, requests=1, max_tokens=1)
