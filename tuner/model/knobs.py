"""The flags the tuner turns: read, change and validate them on an engine's command line.

The command line is an ``EngineArgs`` (``tuner.model.engine_args``: an immutable, ordered list of argv
items that keeps what it does not understand, read and written through the one reader and writer of
command lines, ``tuner.portable.argv``); this module knows which of its flags are knobs and what they mean.

The knobs (``KNOBS``) are engine-agnostic names with one flag per engine kind (``FLAGS``):

============================  ==============================  ==================================
knob                          vLLM                            SGLang
============================  ==============================  ==================================
max_num_seqs                  --max-num-seqs                  --max-running-requests
max_model_len                 --max-model-len                 --context-length
max_num_batched_tokens        --max-num-batched-tokens        --chunked-prefill-size
block_size                    --block-size                    --page-size
gpu_memory_utilization        --gpu-memory-utilization        --mem-fraction-static
chunked_prefill (bool)        --[no-]enable-chunked-prefill   --chunked-prefill-size -1 = off
============================  ==============================  ==================================

Every numeric knob has a hard sanity range (``Knob.range``, ``RANGES``) that no command line, rule file
or proposal may leave: a value outside it on a command line is an error (``validate``) and unknown
(``effective``), never a number the core computes with, and the rule schema refuses bounds and values
outside it. The ranges follow vLLM 0.32's own limits (config/scheduler.py, config/cache.py) where vLLM
has one and cap at a generous "no real deployment goes there" where it has none; each says why.

Values are text in argv and numbers here: ``parse_int`` reads vLLM's human-readable integers
(``1k`` = 1000, ``1K`` = 1024, ``25.6k`` = 25600; engine-contract.md §2). ``effective`` answers "what does
the engine run with" when a flag is absent — vLLM's defaults depend on the platform (GPU memory,
CPU), so the caller passes the defaults it knows (``documented_defaults`` plus live config signals);
an unknown default is ``None`` with a reason, never a guess. ``validate`` implements vLLM's startup
checks so a plan never proposes a command line the engine would refuse.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

# The command line itself (parse, read, change: ``engine_args``); the knobs below are read from it and
# written to it. Its names are this module's too, where the tuner has always looked for them.
from tuner.model.engine_args import EngineArgs as EngineArgs
from tuner.model.engine_args import Value as Value
from tuner.model.engine_args import format_value as format_value
from tuner.model.engine_args import normalize_flag as normalize_flag

EngineKind = Literal["vllm", "sglang"]
ValueType = Literal["int", "float", "bool"]


# --- the knob table -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Range:
    """A knob's hard sanity range: ``[low, high]``, or ``(low, high]`` with ``low_open``."""

    low: float
    high: float
    why: str
    low_open: bool = False
    integer: bool = True

    def contains(self, value: float) -> bool:
        if isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
            return False
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high

    def describe(self) -> str:
        if self.integer and self.low == 1 and not self.low_open:
            return f"a positive integer ≤ {format_value(self.high)}"
        return f"{'(' if self.low_open else '['}{format_value(self.low)}, {format_value(self.high)}]"

    def problem(self, value: float) -> str | None:
        """Why ``value`` is outside (None: inside)."""
        if self.contains(value):
            return None
        if isinstance(value, int):
            digits = str(value)
            shown = digits if len(digits) <= 20 else f"{digits[:8]}… ({len(digits)} digits)"
        else:
            shown = f"{value:.6g}"
        return f"{shown} is outside the tuner's hard range: must be {self.describe()} ({self.why})"


@dataclass(frozen=True, slots=True)
class Knob:
    """One tunable engine setting with its flag on each engine (``None``: the engine has none)."""

    name: str
    type: ValueType
    vllm: str | None
    sglang: str | None
    description: str
    aliases: tuple[str, ...] = ()  # other spellings the engines accept for the same setting
    restart: bool = True  # every knob here is fixed at startup (engine-contract.md §3: no runtime endpoint)
    range: Range | None = None  # None only for booleans

    def flag(self, kind: EngineKind) -> str | None:
        return self.vllm if kind == "vllm" else self.sglang


# Why these ranges (vLLM 0.32: config/scheduler.py, config/cache.py; the same bounds hold for SGLang's
# flags, whose limits are no wider in practice):
# - max_num_seqs ≥ 1 (vLLM: ge=1, no upper limit). Real deployments run 8..2048; vLLM's largest default
#   is 1024. 65536 slots is 32× past that and still small enough that a factor-of-a-billion rule is
#   caught long before it would be a command line.
# - max_model_len ≥ 1 (vLLM refuses more than the model's derived length unless
#   VLLM_ALLOW_LONG_MAX_MODEL_LEN). The longest released contexts are ~10M tokens: cap at 2^24 = 16.8M.
# - max_num_batched_tokens ≥ 1 (vLLM: ge=1; largest default 16384). With chunked prefill off it must be
#   ≥ max_model_len, so it shares max_model_len's ceiling, 2^24.
# - block_size > 0 (vLLM: gt=0); the largest size any attention kernel accepts is 1024 (FlashInfer on
#   Blackwell, ``BLOCK_SIZES``). Hybrid (Mamba) models may get a larger block *from vLLM itself*; the
#   flag never needs one.
# - gpu_memory_utilization in (0, 1] (vLLM: gt=0, le=1), a fraction of one GPU's memory.
_TOKENS_CAP = 2**24
RANGES: Mapping[str, Range] = MappingProxyType({
    "max_num_seqs": Range(1, 65536, "vLLM needs ≥ 1; real deployments run ≤ 2048 sequence slots"),
    "max_model_len": Range(1, _TOKENS_CAP, "vLLM needs ≥ 1; the longest released contexts are ~10M tokens"),
    "max_num_batched_tokens": Range(1, _TOKENS_CAP, "vLLM needs ≥ 1; with chunked prefill off it must "
                                    "reach max_model_len, so it shares its ceiling"),
    "block_size": Range(1, 1024, "vLLM needs > 0; no attention kernel takes blocks over 1024 tokens"),
    "gpu_memory_utilization": Range(0, 1, "a fraction of one GPU's memory, as vLLM requires", low_open=True,
                                    integer=False),
})

KNOBS: Mapping[str, Knob] = MappingProxyType({
    k.name: k for k in (
        Knob("max_num_seqs", "int", "--max-num-seqs", "--max-running-requests",
             "sequence slots: the most requests the scheduler runs at once", range=RANGES["max_num_seqs"]),
        Knob("max_model_len", "int", "--max-model-len", "--context-length",
             "the longest prompt + output a request may have (tokens)", range=RANGES["max_model_len"]),
        Knob("max_num_batched_tokens", "int", "--max-num-batched-tokens", "--chunked-prefill-size",
             "tokens per scheduler step (the prefill chunk budget)", range=RANGES["max_num_batched_tokens"]),
        Knob("block_size", "int", "--block-size", "--page-size", "tokens per KV-cache block/page",
             range=RANGES["block_size"]),
        Knob("gpu_memory_utilization", "float", "--gpu-memory-utilization", "--mem-fraction-static",
             "fraction of GPU memory the engine may take (weights + activations + KV cache)",
             aliases=("--device-memory-utilization",), range=RANGES["gpu_memory_utilization"]),
        Knob("chunked_prefill", "bool", "--enable-chunked-prefill", "--chunked-prefill-size",
             "split long prompts into chunks that share steps with decoding"),
    )
})

# SGLang has no boolean for chunked prefill: ``--chunked-prefill-size -1`` turns it off.
_SGLANG_CHUNKING_OFF = "-1"


def _by_flag(kind: EngineKind) -> Mapping[str, Knob]:
    out: dict[str, Knob] = {}
    for knob in KNOBS.values():
        flag = knob.flag(kind)
        if flag is None:
            continue
        # For SGLang --chunked-prefill-size is first of all the batched-token budget.
        out.setdefault(flag, knob)
        if kind == "vllm":
            for alias in knob.aliases:
                out.setdefault(alias, knob)
    return MappingProxyType(out)


FLAGS: Mapping[EngineKind, Mapping[str, Knob]] = MappingProxyType(
    {"vllm": _by_flag("vllm"), "sglang": _by_flag("sglang")}
)
"""flag name → knob, per engine kind."""


def knob_for(flag: str) -> Knob | None:
    """The knob a flag names, in either engine's spelling (``--max-running-requests`` → max_num_seqs)."""
    flag = normalize_flag(flag)
    if flag in KNOBS:  # a knob name is accepted too
        return KNOBS[flag]
    for table in FLAGS.values():
        if flag in table:
            return table[flag]
    return None


def known_flags() -> list[str]:
    return sorted({f for table in FLAGS.values() for f in table})


# vLLM flags that take no value (argparse store_true / BooleanOptionalAction): BOOLEAN_FLAGS, one table
# shared with the in-pod launcher (stdlib only, so it lives there). A bare token after one of these is a
# positional, not its value. Unknown flags followed by a non-flag token are read as ``--flag value``, which
# is what argparse does for every flag that takes a value.


# --- human-readable integers -------------------------------------------------------------------------

_HUMAN = re.compile(r"^(?P<num>\d+(?:\.\d+)?)(?P<unit>[kKmMgGtT]?)$")
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_int(text: str) -> int:
    """vLLM's human-readable int: ``8192``, ``8k`` (8000), ``8K`` (8192), ``25.6k`` (25600), ``-1``.

    Lower-case suffixes are decimal, upper-case binary; a fraction must give a whole number and is
    not allowed with a binary suffix (as in vLLM's ``human_readable_int``). Raises ValueError.
    """
    s = text.strip()
    if re.fullmatch(r"-?\d+", s):
        return int(s)
    m = _HUMAN.match(s)
    if m is None:
        raise ValueError(f"not an integer: {text!r} (expected e.g. 8192, 8k = 8000 or 8K = 8192)")
    num, unit = m.group("num"), m.group("unit")
    power = _POWERS[unit.lower()]
    if unit.isupper():
        if "." in num:
            raise ValueError(f"{text!r}: a fraction needs a decimal suffix (k, m, g), not a binary one")
        return int(num) * int(1024**power)
    value = float(num) * float(1000**power)
    if not value.is_integer():
        raise ValueError(f"{text!r} is not a whole number of tokens")
    return int(value)


def parse_value(knob: Knob | str, text: str) -> Value:
    """``text`` (argv spelling) as the knob's value type; ``knob`` by name or either engine's flag."""
    return _parse_value(_knob(knob), text)


def _parse_value(knob: Knob, text: str) -> Value:
    if knob.type == "int":
        return parse_int(text)
    if knob.type == "float":
        value = float(text)
        if math.isnan(value) or math.isinf(value):
            raise ValueError(f"not a finite number: {text!r}")
        return value
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


# --- knob values on a command line --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Effective:
    """What the engine runs with for one knob, and where that came from."""

    value: Value | None
    source: Literal["args", "default", "unknown", "live"]
    reason: str | None = None

    @property
    def is_known(self) -> bool:
        return self.value is not None


def _knob(knob: Knob | str) -> Knob:
    if isinstance(knob, Knob):
        return knob
    found = knob_for(knob)
    if found is None:
        raise KeyError(f"unknown knob or flag {knob!r}; known: {', '.join(known_flags())}")
    return found


def explicit(args: EngineArgs, knob: Knob | str, kind: EngineKind = "vllm") -> Value | None:
    """The knob's value as written on the command line, parsed; None if absent (or ``auto``).

    Raises ValueError for text the engine would refuse (``--max-num-seqs lots``) and for a value
    outside the knob's hard range (``Knob.range``).
    """
    k = _knob(knob)
    flag = k.flag(kind)
    if flag is None:
        return None
    candidates = [flag, *(k.aliases if kind == "vllm" else ())]
    raw: str | bool | None = None
    for f in candidates:
        raw = args.get(f)
        if raw is not None:
            break
    if raw is None:
        return None
    if kind == "sglang" and k.name == "chunked_prefill":
        return raw != _SGLANG_CHUNKING_OFF
    if isinstance(raw, bool):
        if k.type != "bool":
            raise ValueError(f"{flag} needs a value")
        return raw
    if k.name == "max_model_len" and raw.strip().lower() in ("auto", "-1"):
        return None  # "fit to memory": only the live engine knows
    if kind == "sglang" and k.name == "max_num_batched_tokens" and raw.strip() == _SGLANG_CHUNKING_OFF:
        return None  # chunking off: no chunk budget
    value = _parse_value(k, raw)
    if k.range is not None and not isinstance(value, bool):
        why = k.range.problem(value)
        if why is not None:
            raise ValueError(why)
    return value


def effective(knob: Knob | str, args: EngineArgs, *, kind: EngineKind = "vllm",
              defaults: Mapping[str, Value] | None = None) -> Effective:
    """The value the engine runs with: the command line's, else ``defaults[knob name]``, else unknown.

    ``defaults`` is keyed by knob name (``max_num_seqs``) or by flag; build it from
    ``documented_defaults`` and the live config signals (block_size, gpu_memory_utilization,
    max_model_len come from the running engine).
    """
    k = _knob(knob)
    flag = k.flag(kind)
    if flag is None:
        return Effective(None, "unknown", f"{kind} has no flag for {k.name}")
    try:
        value = explicit(args, k, kind)
    except ValueError as exc:
        return Effective(None, "unknown", f"{flag}: {exc}")
    if value is not None:
        return Effective(value, "args")
    for key in (k.name, flag):
        if defaults is not None and key in defaults:
            return Effective(defaults[key], "default")
    raw = args.get(flag)
    if k.name == "max_model_len" and isinstance(raw, str):
        return Effective(None, "unknown", f"{flag} {raw}: fitted to memory at startup; pass the served value")
    return Effective(None, "unknown", f"{flag} is not on the command line and its default is not known "
                     "here (it depends on the platform; pass it explicitly or as a known default)")


def with_knob(args: EngineArgs, knob: Knob | str, value: Value, *, kind: EngineKind = "vllm") -> EngineArgs:
    """``args`` with the knob set to ``value``, spelled the way ``kind`` wants it."""
    k = _knob(knob)
    flag = k.flag(kind)
    if flag is None:
        raise KeyError(f"{kind} has no flag for {k.name}")
    if kind == "sglang" and k.name == "chunked_prefill":
        if value:
            return args.without(flag) if args.get(flag) == _SGLANG_CHUNKING_OFF else args
        return args.with_value(flag, _SGLANG_CHUNKING_OFF)
    if k.type == "bool":
        return args.with_value(flag, bool(value))
    if k.type == "int":
        return args.with_value(flag, int(value))
    return args.with_value(flag, float(value))


def documented_defaults(
    kind: EngineKind = "vllm",
    *,
    platform: str | None = None,
    gpu_memory_gib: float | None = None,
    gpu_name: str | None = None,
    parallel: int = 1,
) -> dict[str, Value]:
    """The defaults vLLM documents for ``vllm serve`` (engine-contract.md §2), as far as the inputs allow.

    ``platform`` "cuda" needs ``gpu_memory_gib`` (per GPU) for the scheduler budgets; "cpu" does not.
    ``parallel`` is TP × PP. Anything that cannot be derived is left out (→ unknown in ``effective``).
    The KV block size on CUDA depends on the attention backend: read it from the live
    ``vllm:cache_config_info`` instead (the ``block_size`` signal).
    """
    out: dict[str, Value] = {"chunked_prefill": True}  # generative decoder models (the tuner's case)
    if kind != "vllm":
        return out
    if platform == "cpu":
        out.update(max_num_seqs=128 * parallel, max_num_batched_tokens=2048 * parallel, block_size=128)
    elif platform == "cuda" and gpu_memory_gib is not None:
        is_a100 = gpu_name is not None and "A100" in gpu_name.upper()
        if gpu_memory_gib >= 160:
            seqs, batched = 1024, 16384
        elif gpu_memory_gib >= 70 and not is_a100:
            seqs, batched = 1024, 8192
        else:
            seqs, batched = 256, 2048
        out.update(max_num_seqs=min(seqs, batched), max_num_batched_tokens=batched)
    return out


# --- startup validation ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlockSizes:
    """Block sizes an attention backend accepts: a set, or multiples of a number."""

    multiple_of: int | None = None
    allowed: frozenset[int] | None = None
    note: str = ""

    def accepts(self, size: int) -> bool:
        if size <= 0:
            return False
        if self.allowed is not None and size not in self.allowed:
            return False
        return self.multiple_of is None or size % self.multiple_of == 0

    def describe(self) -> str:
        if self.allowed is not None:
            return "one of " + ", ".join(str(s) for s in sorted(self.allowed))
        if self.multiple_of is not None:
            return f"a multiple of {self.multiple_of}"
        return "a positive integer"


# engine-contract.md §2 "Block-size constraints by platform". "cuda" means FlashAttention/Triton (the default
# backends for standard models); name the backend for the others.
BLOCK_SIZES: Mapping[str, BlockSizes] = MappingProxyType({
    "cuda": BlockSizes(multiple_of=16, note="FlashAttention/Triton"),
    "cuda-flashattention": BlockSizes(multiple_of=16),
    "cuda-triton": BlockSizes(multiple_of=16),
    "cuda-flashinfer": BlockSizes(allowed=frozenset({16, 32, 64})),
    "cuda-flashinfer-blackwell": BlockSizes(allowed=frozenset({16, 32, 64, 128, 256, 512, 1024})),
    "cuda-flashmla": BlockSizes(allowed=frozenset({64})),
    "cuda-cutlass-mla": BlockSizes(allowed=frozenset({128})),
    "cuda-flashinfer-mla": BlockSizes(allowed=frozenset({32, 64})),
    "cpu": BlockSizes(note="any size; not a multiple of 32 only warns"),
})

PLATFORMS = tuple(BLOCK_SIZES)


def block_size_ok(size: int, platform: str | None) -> bool:
    if size <= 0:
        return False
    rule = BLOCK_SIZES.get(platform or "")
    return rule is None or rule.accepts(size)


_VALIDATED: dict[object, tuple[str, ...]] = {}  # validate's answers: a command line is checked every cycle it is proposed
_VALIDATED_MAX = 1024


def validate(args: EngineArgs, kind: EngineKind = "vllm", *, platform: str | None,
             defaults: Mapping[str, Value] | None = None) -> list[str]:
    """Why the engine would refuse to start with ``args`` (empty: it would start). A pure function of its
    arguments, so its answers are kept (``_checked``): the planner checks the command line of every proposal
    that reaches its start-up guard, the same one cycle after cycle while the proposal waits for evidence."""
    try:  # each default with its type: True, 1 and 1.0 are equal keys but not the same default
        key: object = (args.items, kind, platform,
                       None if defaults is None else tuple((k, type(v), v) for k, v in sorted(defaults.items())))
        found = _VALIDATED.get(key)
    except TypeError:  # a default that cannot be a key
        return _checked(args, kind, platform=platform, defaults=defaults)
    if found is None:
        if len(_VALIDATED) >= _VALIDATED_MAX:
            _VALIDATED.clear()
        found = _VALIDATED[key] = tuple(_checked(args, kind, platform=platform, defaults=defaults))
    return list(found)


def _checked(args: EngineArgs, kind: EngineKind, *, platform: str | None,
             defaults: Mapping[str, Value] | None) -> list[str]:
    """``validate`` computed:

    Every explicit value within its knob's hard range (``RANGES``: this covers vLLM's own ≥ 1 and
    gpu-memory-utilization in (0, 1]); vLLM (config/scheduler.py, config/cache.py):
    max_num_batched_tokens ≥ max_num_seqs always; ≥ max_model_len when chunked prefill is off (only an
    *explicit* budget — a defaulted one is raised to max_model_len by vLLM itself); block size per
    platform (``BLOCK_SIZES``); --max-num-active-seqs ≤ max_num_seqs. Values that cannot be known
    (absent, no default) are not checked.
    """
    problems: list[str] = []
    values: dict[str, Effective] = {}
    for name, knob in KNOBS.items():
        flag = knob.flag(kind)
        if flag is None:
            continue
        try:
            explicit(args, knob, kind)
        except ValueError as exc:
            problems.append(f"{flag}: {exc}")
            continue
        values[name] = effective(knob, args, kind=kind, defaults=defaults)

    def num(name: str) -> float | None:
        e = values.get(name)
        if e is None or e.value is None or isinstance(e.value, bool):
            return None
        return float(e.value)

    def flag_of_knob(name: str) -> str:
        return KNOBS[name].flag(kind) or name

    gmu = num("gpu_memory_utilization")
    if gmu is not None and values["gpu_memory_utilization"].source == "default" and not 0 < gmu <= 1:
        problems.append(f"{flag_of_knob('gpu_memory_utilization')} {format_value(gmu)}: must be in (0, 1] "
                        "(a fraction of the GPU's memory)")

    if kind == "sglang":
        return problems

    seqs, mml, batched = num("max_num_seqs"), num("max_model_len"), num("max_num_batched_tokens")
    if batched is not None and seqs is not None and batched < seqs:
        problems.append(
            f"--max-num-batched-tokens {format_value(batched)} < --max-num-seqs {format_value(seqs)}: vLLM "
            "refuses to start (every running sequence needs at least one token per step)")
    chunked = values.get("chunked_prefill")
    if (chunked is not None and chunked.value is False and batched is not None and mml is not None
            and values["max_num_batched_tokens"].source == "args" and batched < mml):
        problems.append(
            f"--max-num-batched-tokens {format_value(batched)} < --max-model-len {format_value(mml)} with "
            "chunked prefill off: vLLM refuses to start (a whole prompt must fit in one step); turn "
            "chunked prefill on or raise the budget")
    block = num("block_size")
    if block is not None and values["block_size"].source == "args" and block >= 1:
        rule = BLOCK_SIZES.get(platform or "")
        if rule is not None and not rule.accepts(int(block)):
            problems.append(f"--block-size {format_value(block)}: the {platform} attention backend needs "
                            f"{rule.describe()}")
    active = args.get("--max-num-active-seqs")
    if isinstance(active, str) and seqs is not None:
        try:
            if parse_int(active) > seqs:
                problems.append(f"--max-num-active-seqs {active} > --max-num-seqs {format_value(seqs)}: "
                                "vLLM refuses to start")
        except ValueError as exc:
            problems.append(f"--max-num-active-seqs: {exc}")
    return problems


def changed_knobs(before: EngineArgs, after: EngineArgs, *, kind: EngineKind = "vllm") -> list[str]:
    """Names of the knobs whose command-line value differs between two arg lists."""
    out = []
    for name, knob in KNOBS.items():
        if knob.flag(kind) is None:
            continue
        try:
            if explicit(before, knob, kind) != explicit(after, knob, kind):
                out.append(name)
        except ValueError:
            out.append(name)
    return out


def merged_defaults(*layers: Mapping[str, Value] | None) -> dict[str, Value]:
    """Later layers win; keys may be knob names or flags (normalised to knob names)."""
    out: dict[str, Value] = {}
    for layer in layers:
        for key, value in (layer or {}).items():
            k = knob_for(key)
            out[k.name if k is not None else key] = value
    return out


def parse_defaults(pairs: Iterable[str]) -> dict[str, Value]:
    """``["--max-num-seqs=256", "block_size=16"]`` → ``{"max_num_seqs": 256, "block_size": 16}``."""
    out: dict[str, Value] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        knob = knob_for(key.strip())
        if not sep or knob is None:
            raise ValueError(f"{pair!r}: expected FLAG=VALUE with one of {', '.join(known_flags())}")
        out[knob.name] = _parse_value(knob, text.strip())
    return out
