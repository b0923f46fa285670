"""The part that runs inside the EngineCore: one ``Controller`` per scheduler, driven from ``schedule()``.

Rule 1: the scheduler is changed only at the start of ``schedule()``, in the engine-core thread, between
steps, never from another thread and never mid-step.
Rule 2: nothing leaves the startup envelope: the admission cap stays within 1..``--max-num-seqs``, the
token budget within ``--max-num-seqs``..``--max-num-batched-tokens`` and only when
``engines.token_budget_refusal`` found it safe.
Rule 3: nothing raises into vLLM. A refusal is written into the acknowledgement; an unexpected error
restores the startup values, stops the plugin and says so in the acknowledgement.

Cost per step: one clock read and two attribute writes; every ``POLL_SECONDS`` one ``lstat`` of
``control.json``; reading it, checking it and writing the acknowledgement only when it changed (a few
hundred bytes of local file I/O), or when what the scheduler enforces changed (a drain-down step).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from vllm_tuner_plugin import __version__ as PLUGIN_VERSION
from vllm_tuner_plugin import engines, protocol

# Under "vllm." so that vLLM's own logging configuration formats and prints it.
logger = logging.getLogger("vllm.tuner_live")

POLL_SECONDS = 0.2
CONTROLLER_ATTR = "_vllm_tuner_live"
WRAPPED_MARK = "__vllm_tuner_wrapped__"


class Controller:
    """Applies the tuner's requests to one scheduler. Built after ``Scheduler.__init__``; its
    ``before_step`` runs at the start of every ``schedule()``."""

    def __init__(
        self,
        scheduler: Any,
        *,
        control_dir: str,
        engine_version: str,
        refusal: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        uid: int | None = None,
        launch: protocol.Launch | None = None,
        argv: list[str] | None = None,
        groups: frozenset[int] | None = None,
    ) -> None:
        self.control_dir = control_dir
        self.engine_version = engine_version
        self._clock = clock
        self._wall = wall_clock
        self._uid = os.geteuid() if uid is None else uid
        self._groups = protocol.own_groups() if groups is None else groups
        self.dp_rank = _dp_rank(scheduler)
        # This ack belongs to this launch (protocol docstring): the launch's first process named it in the
        # environment this EngineCore inherited; the rank count from the config or the command line.
        self.launch = launch if launch is not None else protocol.this_launch(parent=True)
        self.ranks = protocol.rank_count(getattr(getattr(scheduler, "vllm_config", None), "parallel_config", None),
                                         argv)
        self.profile: engines.Profile | None = None
        if refusal is None:
            self.profile, refusal = engines.check_scheduler(scheduler, engine_version)
        self.refusal = refusal  # the whole plugin is off when set
        config = getattr(scheduler, "scheduler_config", None)
        self.max_num_seqs = getattr(config, "max_num_seqs", None)
        self.startup_tokens = getattr(scheduler, "max_num_scheduled_tokens", None)
        self.not_live: dict[str, str] = {}
        if self.profile is None:
            self.startup_cap = None
            self.not_live = dict.fromkeys(protocol.KNOBS, refusal or "refused")
        else:
            self.startup_cap = getattr(scheduler, self.profile.cap_attr)
            why = engines.token_budget_refusal(scheduler, self.profile)
            if why is not None:
                self.not_live["max_num_batched_tokens"] = why
        self.startup_active = getattr(scheduler, "max_num_active_reqs", self.max_num_seqs)
        # What the tuner asked for, resolved against the startup values.
        self.target_cap = self.startup_cap
        self.target_tokens = self.startup_tokens
        self.seq: int | None = None  # the request last handled (applied or refused)
        self.in_force_seq: int | None = None  # the request now in force (None: startup values)
        self.applied: dict[str, int | None] | None = None
        self.request_refusal: str | None = None
        self._file_key: tuple[int, ...] | None = None
        self._next_poll = 0.0
        self._ack_due = True
        self._written: tuple[Any, ...] | None = None
        self._ack_error_logged = False
        self._ensure_dir()
        self._remove_stale()
        if self.refusal is not None:
            logger.warning("vllm-tuner live knobs refused, nothing will be applied: %s", self.refusal)
        else:
            assert self.profile is not None
            logger.info(
                "vllm-tuner live knobs: vLLM %s (%s), %s via %s, envelope max_num_seqs=%s "
                "max_num_batched_tokens=%s, control dir %s, ack %s%s",
                engine_version, "known" if self.profile.known else "not in the table; attributes checked",
                self.profile.mode, self.profile.cap_attr, self.max_num_seqs, self.startup_tokens,
                control_dir, os.path.basename(protocol.ack_path(control_dir, self.dp_rank)),
                "".join(f"; {k} not live: {v}" for k, v in self.not_live.items()),
            )
        self._write_ack(scheduler)

    # -- the per-step hook ------------------------------------------------------------------------
    def before_step(self, scheduler: Any) -> None:
        """Run at the start of ``schedule()``. Never raises."""
        if self.refusal is not None:
            return
        try:
            now = self._clock()
            tick = now >= self._next_poll
            if tick:
                self._next_poll = now + POLL_SECONDS
                self._poll()
            self._enforce(scheduler)
            if tick:
                self._maybe_ack(scheduler)
        except Exception as exc:  # noqa: BLE001 - a bug here must not take the engine down
            self._fail(scheduler, exc)

    def _enforce(self, scheduler: Any) -> None:
        assert self.profile is not None
        if self.profile.mode == engines.FOLLOW_DOWN:
            # Never below the running count (the end-of-step assert), never above --max-num-seqs.
            cap = min(self.max_num_seqs, max(self.target_cap, len(scheduler.running)))
        else:
            cap = self.target_cap
        if getattr(scheduler, self.profile.cap_attr) != cap:
            setattr(scheduler, self.profile.cap_attr, cap)
        if "max_num_batched_tokens" not in self.not_live and scheduler.max_num_scheduled_tokens != self.target_tokens:
            scheduler.max_num_scheduled_tokens = self.target_tokens

    # -- reading the control file -----------------------------------------------------------------
    def _poll(self) -> None:
        path = os.path.join(self.control_dir, protocol.CONTROL_FILE)
        try:
            st = os.lstat(path)
            key: tuple[int, ...] | None = (st.st_ino, st.st_mtime_ns, st.st_size, st.st_mode, st.st_uid,
                                               st.st_gid)
        except FileNotFoundError:
            key = None  # no file, or removed: keep what is in force
        except OSError as exc:
            key = (-1, exc.errno or 0)
        if key == self._file_key:
            return
        self._file_key = key
        if key is None:
            return
        try:
            request = protocol.read_control(self.control_dir, uid=self._uid, groups=self._groups)
        except protocol.ProtocolError as exc:
            self._refuse(exc.seq, exc.reason)
            return
        if request is None:
            return
        why = self._envelope_refusal(request)
        if why is not None:
            self._refuse(request.seq, why)
            return
        cap, tokens = request.max_num_active_seqs, request.max_num_batched_tokens
        self.target_cap = cap if cap is not None else self.startup_cap
        self.target_tokens = tokens if tokens is not None else self.startup_tokens
        self.seq = self.in_force_seq = request.seq
        self.applied = request.knobs()
        self.request_refusal = None
        self._ack_due = True
        logger.info("vllm-tuner live knobs: applied seq %s: max_num_active_seqs=%s max_num_batched_tokens=%s",
                    request.seq, self.target_cap, self.target_tokens)

    def _envelope_refusal(self, request: protocol.Request) -> str | None:
        cap, tokens = request.max_num_active_seqs, request.max_num_batched_tokens
        if cap is not None and not 1 <= cap <= self.max_num_seqs:
            return (f"max_num_active_seqs {cap} is outside the startup envelope 1..{self.max_num_seqs} "
                    "(--max-num-seqs); nothing applied")
        if tokens is not None and tokens != self.startup_tokens:
            why = self.not_live.get("max_num_batched_tokens")
            if why is not None:
                return f"max_num_batched_tokens is not live on this engine: {why}; nothing applied"
            if not self.max_num_seqs <= tokens <= self.startup_tokens:
                return (f"max_num_batched_tokens {tokens} is outside the startup envelope "
                        f"{self.max_num_seqs}..{self.startup_tokens} (it may only be lowered from "
                        "--max-num-batched-tokens, and vLLM needs at least --max-num-seqs); nothing applied")
        return None

    def _refuse(self, seq: int | None, reason: str) -> None:
        self.seq = seq
        self.applied = None
        self.request_refusal = reason
        self._ack_due = True
        logger.warning("vllm-tuner live knobs: refused request seq %s: %s", seq, reason)

    # -- the acknowledgement ----------------------------------------------------------------------
    def effective(self, scheduler: Any) -> dict[str, Any]:
        """What the scheduler enforces now. ``admission_cap`` is the attribute's value this step; with
        follow-down it stays above ``max_num_active_seqs`` until enough requests have finished."""
        if self.profile is None:
            return {}
        running = len(scheduler.running)
        cap_now = getattr(scheduler, self.profile.cap_attr)
        return {
            "seq": self.in_force_seq,
            "max_num_active_seqs": self.target_cap,
            "max_num_batched_tokens": self.target_tokens,
            "admission_cap": cap_now,
            "running": running,
            "draining": running > self.target_cap or cap_now > self.target_cap,
        }

    def ack(self, scheduler: Any) -> dict[str, Any]:
        effective = self.effective(scheduler)
        document = {
            "protocol": protocol.PROTOCOL,
            "live": self.refusal is None,
            "seq": self.seq,
            "applied": self.applied,
            "refused": self.refusal or self.request_refusal,
            "effective": effective,
            "envelope": {
                "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.startup_tokens,
                "max_num_active_seqs": self.startup_active,
            },
            "not_live": self.not_live,
            "at": self._wall(),
            "pid": os.getpid(),
            "dp_rank": self.dp_rank,
            "engine_version": self.engine_version,
            "engine_known": bool(self.profile and self.profile.known),
            "mode": self.profile.mode if self.profile else None,
            "plugin_version": PLUGIN_VERSION,
            "launch": self.launch.id,
            "launched_at": self.launch.at,
            "ranks": self.ranks,
        }
        assert tuple(document) == protocol.ACK_FIELDS
        return document

    def _maybe_ack(self, scheduler: Any) -> None:
        effective = self.effective(scheduler)
        key = (self.seq, self.request_refusal, effective["admission_cap"], effective["draining"],
               self.target_cap, self.target_tokens)
        if self._ack_due or key != self._written:
            self._write_ack(scheduler)
            self._written = key

    def _write_ack(self, scheduler: Any) -> None:
        self._ack_due = False
        try:
            protocol.write_json_atomically(protocol.ack_path(self.control_dir, self.dp_rank), self.ack(scheduler))
        except OSError as exc:
            if not self._ack_error_logged:  # once: a full or read-only disk must not flood the log
                logger.warning("vllm-tuner live knobs: cannot write the acknowledgement in %s: %s",
                               self.control_dir, exc)
                self._ack_error_logged = True

    def _ensure_dir(self) -> None:
        try:
            os.makedirs(self.control_dir, mode=0o700, exist_ok=True)
        except OSError as exc:
            logger.warning("vllm-tuner live knobs: cannot create %s: %s", self.control_dir, exc)

    def _remove_stale(self) -> None:
        """The acks earlier launches left here would disagree with this launch's (a rank that no longer
        exists never writes its file again): removed before this rank writes its own."""
        try:
            removed = protocol.remove_stale(self.control_dir, self.launch)
        except Exception:  # the tuner ignores them anyway; never a reason to fail the engine
            logger.exception("vllm-tuner live knobs: could not remove the acknowledgements of earlier launches")
            return
        if removed:
            logger.info("vllm-tuner live knobs: removed the acknowledgements of earlier launches: %s",
                        ", ".join(removed))

    def _fail(self, scheduler: Any, exc: BaseException) -> None:
        logger.error("vllm-tuner live knobs: internal error; restoring the startup values and stopping",
                     exc_info=exc)
        self.refusal = f"internal error ({type(exc).__name__}: {exc}); startup values restored, plugin stopped"
        try:
            assert self.profile is not None
            # Back to the startup values: both are at least what any step so far allowed, so safe.
            setattr(scheduler, self.profile.cap_attr, self.startup_cap)
            scheduler.max_num_scheduled_tokens = self.startup_tokens
            self.target_cap, self.target_tokens = self.startup_cap, self.startup_tokens
        except Exception:
            logger.exception("vllm-tuner live knobs: restoring the startup values failed")
        try:
            self._write_ack(scheduler)
        except Exception:
            logger.exception("vllm-tuner live knobs: writing the final acknowledgement failed")


def _dp_rank(scheduler: Any) -> int:
    """This engine's data-parallel rank. ``data_parallel_index`` first: for a model without MoE, vLLM
    (0.26, 0.32) runs each DP rank as an independent engine and resets its ``data_parallel_rank`` to 0,
    keeping the original rank in ``data_parallel_index``."""
    parallel = getattr(getattr(scheduler, "vllm_config", None), "parallel_config", None)
    for name in ("data_parallel_index", "data_parallel_rank"):
        rank = getattr(parallel, name, None)
        if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0:
            return rank
    return 0


def install(scheduler_cls: type, *, engine_version: str, control_dir: str, refusal: str | None = None) -> bool:
    """Wrap ``scheduler_cls.__init__`` (to attach a ``Controller``) and, unless the plugin is refused
    already, ``scheduler_cls.schedule`` (to call it first). Subclasses that call ``super().schedule()``
    (all of vLLM's own) go through the wrapper too. Idempotent; returns whether it wrapped anything."""
    original_init = scheduler_cls.__init__
    if getattr(original_init, WRAPPED_MARK, False):
        return False

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        try:
            setattr(self, CONTROLLER_ATTR, Controller(self, control_dir=control_dir,
                                                      engine_version=engine_version, refusal=refusal))
        except Exception:
            logger.exception("vllm-tuner live knobs: could not attach to the scheduler; nothing applied")

    setattr(__init__, WRAPPED_MARK, True)
    __init__.__wrapped__ = original_init  # type: ignore[attr-defined]
    scheduler_cls.__init__ = __init__  # type: ignore[misc]
    if refusal is not None:
        return True

    original_schedule = scheduler_cls.schedule

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        controller = self.__dict__.get(CONTROLLER_ATTR)
        if controller is not None:
            controller.before_step(self)
        return original_schedule(self, *args, **kwargs)

    setattr(schedule, WRAPPED_MARK, True)
    schedule.__wrapped__ = original_schedule  # type: ignore[attr-defined]
    schedule.__name__ = original_schedule.__name__
    schedule.__doc__ = original_schedule.__doc__
    scheduler_cls.schedule = schedule  # type: ignore[attr-defined]
    return True
