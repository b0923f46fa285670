"""Which vLLM versions this plugin knows, and the checks it makes before it touches a scheduler.

What each known version does with the attributes the plugin touches (read in each version's
``vllm/v1/core/sched/scheduler.py``):

- **0.32** (vLLM PR 56758, ``--max-num-active-seqs``): ``max_num_active_reqs`` gates WAITING -> RUNNING
  (``len(running) + num_waiting_for_streaming_input >= max_num_active_reqs`` stops admission) and nothing
  else reads it; ``max_num_running_reqs`` (= ``--max-num-seqs``) only bounds: ``schedule()`` ends with
  ``assert len(self.running) <= self.max_num_running_reqs``. So the cap is ``max_num_active_reqs``, set
  directly; lowering it below the running count drains down (no preemption), as the PR says.
- **0.26**: one attribute, ``max_num_running_reqs``, both admits and bounds (same two lines, same
  assert). Lowering it below ``len(running)`` would trip that assert and kill the engine, so the plugin
  sets it to ``max(target, len(running))`` at the start of every ``schedule()`` and follows it down as
  requests finish ("follow-down"). Within one ``schedule()`` running only shrinks (preemption) or grows
  through admission, which that value bounds, so the assert holds.
- Both: ``max_num_scheduled_tokens`` is the per-step token budget (``token_budget`` at the top of
  ``schedule()``, ``assert total_num_scheduled_tokens <= self.max_num_scheduled_tokens`` at the end).

A version not in the table but not older than the oldest one known is checked by its attributes alone:
the admission cap becomes live if they are what a known version has (``max_num_active_reqs`` -> the
0.32 way, else the 0.26 way), and the token budget stays off. Older versions are refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

ACTIVE_CAP = "active-cap"  # a separate admission attribute (0.32)
FOLLOW_DOWN = "follow-down"  # one attribute admits and bounds (0.26)


@dataclass(frozen=True)
class Profile:
    """How to drive one scheduler."""

    mode: str  # ACTIVE_CAP or FOLLOW_DOWN
    cap_attr: str  # the attribute that gates admission
    known: bool  # the version is in KNOWN
    token_budget: bool  # whether this version's token budget code paths were read and found safe


# (major, minor) -> (mode, token budget checked)
KNOWN: dict[tuple[int, int], tuple[str, bool]] = {
    (0, 26): (FOLLOW_DOWN, True),
    (0, 32): (ACTIVE_CAP, True),
}
OLDEST = min(KNOWN)


def parse_version(text: str) -> tuple[int, int] | None:
    """``"0.32.0"``, ``"0.33.0rc1"``, ``"0.32.1.dev3+gabc"`` -> ``(0, 32)``; None if unreadable."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)", str(text))
    return (int(m.group(1)), int(m.group(2))) if m else None


def version_refusal(version: str) -> str | None:
    """Why this engine version is refused before any scheduler is looked at, or None."""
    parsed = parse_version(version)
    if parsed is None:
        return f"vLLM version {version!r} cannot be read; refusing to touch a scheduler it cannot place"
    if parsed < OLDEST:
        return (f"vLLM {version} is older than {OLDEST[0]}.{OLDEST[1]}, the oldest version this plugin "
                "knows; its scheduler differs")
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_scheduler(scheduler: Any, version: str) -> tuple[Profile | None, str | None]:
    """Check a freshly built scheduler against what the plugin expects of ``version``.

    Returns ``(profile, None)``, or ``(None, reason)``: every attribute the plugin touches must be
    there, have the right type, and agree with the engine's config."""
    why = version_refusal(version)
    if why is not None:
        return None, why
    parsed = parse_version(version)
    assert parsed is not None
    known = KNOWN.get(parsed)
    config = getattr(scheduler, "scheduler_config", None)
    max_num_seqs = getattr(config, "max_num_seqs", None)
    if not _is_int(max_num_seqs) or max_num_seqs < 1:
        return None, f"scheduler_config.max_num_seqs is {max_num_seqs!r}, expected an integer >= 1"
    running_cap = getattr(scheduler, "max_num_running_reqs", None)
    if not _is_int(running_cap) or running_cap != max_num_seqs:
        return None, (f"scheduler.max_num_running_reqs is {running_cap!r}, expected --max-num-seqs "
                      f"({max_num_seqs})")
    if not isinstance(getattr(scheduler, "running", None), list):
        return None, "scheduler.running is not a list"
    streaming = getattr(scheduler, "num_waiting_for_streaming_input", 0)
    if not _is_int(streaming):
        return None, f"scheduler.num_waiting_for_streaming_input is {streaming!r}, expected an integer"
    tokens = getattr(scheduler, "max_num_scheduled_tokens", None)
    batched = getattr(config, "max_num_batched_tokens", None)
    if not _is_int(tokens) or tokens < 1 or not _is_int(batched) or tokens > batched:
        return None, (f"scheduler.max_num_scheduled_tokens is {tokens!r} with --max-num-batched-tokens "
                      f"{batched!r}; expected an integer no larger than it")
    if not callable(getattr(scheduler, "schedule", None)):
        return None, "scheduler has no schedule() method"

    has_active = hasattr(scheduler, "max_num_active_reqs")
    if known is not None:
        mode = known[0]
        if (mode == ACTIVE_CAP) != has_active:
            have = "has" if has_active else "lacks"
            return None, (f"vLLM {version}: the scheduler {have} max_num_active_reqs, unlike the "
                          f"{parsed[0]}.{parsed[1]} this plugin was checked against")
    else:
        mode = ACTIVE_CAP if has_active else FOLLOW_DOWN
    if mode == ACTIVE_CAP:
        active = scheduler.max_num_active_reqs
        startup = getattr(config, "max_num_active_seqs", None)
        expected = startup if startup is not None else max_num_seqs
        if not _is_int(active) or not 1 <= active <= running_cap or active != expected:
            return None, (f"scheduler.max_num_active_reqs is {active!r}, expected --max-num-active-seqs "
                          f"or --max-num-seqs ({expected})")
    cap_attr = "max_num_active_reqs" if mode == ACTIVE_CAP else "max_num_running_reqs"
    return Profile(mode=mode, cap_attr=cap_attr, known=known is not None,
                   token_budget=bool(known and known[1])), None


def token_budget_refusal(scheduler: Any, profile: Profile) -> str | None:
    """Why the per-step token budget may not be lowered live on this engine, or None.

    Lowering ``max_num_scheduled_tokens`` between steps is safe when every request can still make
    progress with fewer tokens per step, i.e. when prompts are chunked and nothing needs a minimum
    chunk. Each condition below is a code path where that fails or that was not checked:

    - chunked prefill off: a prompt longer than the budget blocks the head of the queue for ever
      (``schedule()`` ``break``s); vLLM refuses such a config at startup for the same reason;
    - multimodal / encoder inputs: an item that must be scheduled whole (``_try_schedule_encoder_inputs``)
      and is larger than the budget is never scheduled; the encoder budget was sized at startup;
    - speculative decoding: draft-token padding ``break``s when it does not fit, and
      ``max_num_scheduled_tokens`` is already set below ``max_num_batched_tokens`` to leave draft room;
    - Mamba block-aligned chunking, KV / encoder-cache connectors, pooling and encoder-decoder models:
      not checked.
    """
    if not profile.token_budget:
        return ("this vLLM version is not in the plugin's table of versions whose token-budget code "
                "was checked")
    config = scheduler.scheduler_config
    vllm_config = getattr(scheduler, "vllm_config", None)
    if getattr(config, "enable_chunked_prefill", None) is not True:
        return "chunked prefill is off, so a prompt longer than a lowered budget would never be scheduled"
    if getattr(scheduler, "max_num_encoder_input_tokens", None) != 0:
        return "the model takes encoder (multimodal) inputs, which need a minimum budget per item"
    if getattr(vllm_config, "speculative_config", None) is not None:
        return "speculative decoding is on (draft-token padding needs room in the budget)"
    if getattr(scheduler, "need_mamba_block_aligned_split", False):
        return "the model uses Mamba block-aligned prefill chunks (not checked)"
    if getattr(scheduler, "connector", None) is not None or getattr(scheduler, "ec_connector", None) is not None:
        return "a KV-transfer or encoder-cache connector is configured (not checked)"
    if getattr(scheduler, "is_encoder_decoder", False):
        return "encoder-decoder model (not checked)"
    runner = getattr(getattr(vllm_config, "model_config", None), "runner_type", "generate")
    if runner != "generate":
        return f"runner type {runner!r} (only generative models were checked)"
    if scheduler.max_num_scheduled_tokens != config.max_num_batched_tokens:
        return "--max-num-scheduled-tokens differs from --max-num-batched-tokens (not checked)"
    return None
