"""vllm-tuner's engine-side plugin: change vLLM's admission cap (and, where safe, its per-step token
budget) live, without a restart, inside the envelope the engine was started with.

vLLM loads ``register`` (entry point group ``vllm.general_plugins``) in every process it starts. It does
nothing at all unless ``$VLLM_TUNER_CONTROL_DIR`` is set. See README.md.
"""

from __future__ import annotations

import logging
import os
import time

from vllm_tuner_plugin import protocol

__version__ = "0.4.0"
__all__ = ["__version__", "register"]

logger = logging.getLogger("vllm.tuner_live")
_registered = False


def register() -> None:
    """vLLM's general-plugin hook. Inert unless ``$VLLM_TUNER_CONTROL_DIR`` is set; never raises."""
    global _registered
    control_dir = os.environ.get(protocol.ENV_CONTROL_DIR, "").strip()
    if not control_dir or _registered:
        return
    _registered = True
    control_dir = os.path.abspath(control_dir)
    try:
        # The launch's first process (vLLM loads general plugins in it before it starts its EngineCores):
        # name the launch in the environment they inherit, so that their acks say which launch they are of.
        protocol.this_launch()
        _register(control_dir)
    except Exception as exc:  # noqa: BLE001 - a plugin must not stop vLLM from starting
        _refuse_at_load(control_dir, f"could not hook the scheduler ({type(exc).__name__}: {exc})")


def _register(control_dir: str) -> None:
    from vllm_tuner_plugin import engines, live

    try:
        import vllm

        version = str(getattr(vllm, "__version__", "") or "")
        if not version:
            from vllm.version import __version__ as version
        from vllm.v1.core.sched.scheduler import Scheduler
    except Exception as exc:  # noqa: BLE001 - any import failure means "internals moved"
        _refuse_at_load(control_dir, f"vLLM's v1 scheduler cannot be imported ({type(exc).__name__}: {exc})")
        return
    if not callable(getattr(Scheduler, "schedule", None)):
        _refuse_at_load(control_dir, f"vLLM {version}: Scheduler has no schedule() method")
        return
    # A refused version still gets the __init__ hook, so that each EngineCore writes the refusal into
    # its own acknowledgement; schedule() is then left alone.
    live.install(Scheduler, engine_version=version, control_dir=control_dir,
                 refusal=engines.version_refusal(version))


def _refuse_at_load(control_dir: str, reason: str) -> None:
    """No scheduler to hang an acknowledgement on: log one line and leave ``ack-load.json``."""
    logger.warning("vllm-tuner live knobs refused, nothing will be applied: %s", reason)
    document = dict.fromkeys(protocol.ACK_FIELDS)
    launch = protocol.this_launch()
    document.update(protocol=protocol.PROTOCOL, live=False, refused=reason, at=time.time(), pid=os.getpid(),
                    plugin_version=__version__, not_live=dict.fromkeys(protocol.KNOBS, reason),
                    launch=launch.id, launched_at=launch.at, ranks=protocol.rank_count(None))
    try:
        os.makedirs(control_dir, mode=0o700, exist_ok=True)
        protocol.write_json_atomically(os.path.join(control_dir, "ack-load.json"), document)
    except OSError:
        pass
