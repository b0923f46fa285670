"""A profile: everything platform-specific about one evaluation, in one YAML file.

The engine (interpreter, model, flags, environment), the replica count, nginx, the bad start, the sweep,
the SLO, the trace's phases, the player and the timings. ``bench/evaluation/profiles/`` holds the CPU
(CI and full) and the H200 ones. Validated strictly: an unknown key is an error that names the file and
the field. Paths in a profile are relative to the profile file unless absolute.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bench.evaluation import traces


class ProfileError(Exception):
    """A profile that cannot be used; the message is one line naming the file."""


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class Engine(_Model):
    python: str | None = None
    """The engine's interpreter (vLLM importable). None: ``.venv-vllm/bin/python`` (or
    ``$VLLM_TUNER_VLLM_PYTHON``)."""
    model: str | None = None
    """The model directory. None: the tiny random Llama of harness/vllm.py (built when missing)."""
    served_name: str = "tiny-llama"
    args: list[str] = []
    """Engine flags besides --model, --served-model-name, --host, --port and --max-num-seqs (which the
    harness sets)."""
    env: dict[str, str] = {}
    """Extra environment of every engine."""
    start_timeout_seconds: float = Field(600.0, gt=0)
    start_in_parallel: bool = True
    """Start the replicas of a harness-started pool at the same time (False: one after the other, e.g.
    two engines sharing one GPU, whose memory profiling must not overlap)."""
    vocab_size: int | None = Field(None, gt=16)
    """Token ids of the prompts are drawn below this. None: the model's config.json ``vocab_size``."""


class Sweep(_Model):
    values: list[int] = Field(min_length=1)
    """The --max-num-seqs values of the static sweep (its best goodput is the oracle)."""
    mode: Literal["plugin", "restart"] = "plugin"
    """plugin: one wide-envelope start, the admission cap held at each value through the live-knob
    plugin; restart: the replicas started with --max-num-seqs at each value."""


class Slo(_Model):
    ttft_seconds: float = Field(1.0, gt=0)
    """A request meets the SLO when its time to first token is at most this ..."""
    itl_mean_seconds: float = Field(0.1, gt=0)
    """... and its mean inter-token gap at most this (and it did not fail)."""


class PhaseSpec(_Model):
    name: str = Field(pattern=r"^[a-z][a-z0-9-]*$")
    seconds: float = Field(gt=0)
    rate: float = Field(gt=0)
    """Requests per second, all replicas together."""
    input_len: int = Field(gt=0)
    output_len: int = Field(gt=0)
    burstiness: float = Field(1.0, gt=0)
    """1: Poisson arrivals; below 1: clumped (gamma), as vLLM's benchmark client's --burstiness."""


class Trace(_Model):
    seed: int = 0
    range_ratio: float = Field(0.0, ge=0, lt=1)
    phases: list[PhaseSpec] = Field(min_length=1)

    def build(self) -> dict[str, object]:
        return traces.build([traces.Phase(**p.model_dump()) for p in self.phases], seed=self.seed,
                            range_ratio=self.range_ratio)


class Player(_Model):
    processes: int = Field(1, ge=1, le=64)
    """Player processes sharing the trace (request i goes to process i mod n)."""
    request_timeout_seconds: float = Field(900.0, gt=0)
    python: str | None = None
    """The player's interpreter (needs aiohttp). None: the engine's."""


class Tuner(_Model):
    config: str
    """The restart arm's tuner settings (a partial vllm-tuner config; the harness adds targets, actuator,
    drain, daemon endpoint, state and journal). An empty file means the shipped defaults."""
    live_config: str | None = None
    """The live arm's tuner settings (engines started with a wide envelope and the plugin; the harness turns
    the tuner's ``live`` knobs on and sets each replica's control directory). None: the same as ``config``."""
    settle_seconds: float = Field(0.0, ge=0)
    """Once every request of the trace has ended, keep the tuner running while one of its rollouts is
    still in flight, at most this long (0: stop it at once). It sees no load then, so it starts nothing
    new; this only lets a rollout begun under the trace finish, so its restarts and its outcome are known."""


class Timings(_Model):
    sample_seconds: float = Field(1.0, gt=0)
    """How often each replica's /metrics (and its plugin acknowledgement) is sampled during an arm."""
    bin_seconds: float = Field(10.0, gt=0)
    """Width of the time bins of the report's plots."""
    converge_quiet_seconds: float = Field(60.0, ge=0)
    """A tuner arm converged when its last flag change was decided at least this long before the trace's
    end (so that the trace would have shown another decision) and no rollout was in flight when the tuner
    was stopped."""
    idle_timeout_seconds: float = Field(600.0, gt=0)
    """Between arms: longest wait for every replica to be idle (nothing running or waiting)."""
    lead_in_seconds: float = Field(3.0, ge=0)
    """The trace starts this long after the players were launched (they import aiohttp first)."""


class Profile(_Model):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    description: str = ""
    engine: Engine = Engine()
    replicas: int = Field(2, ge=1, le=16)
    nginx: str | None = None
    """The nginx binary (e.g. one unpacked with ``dpkg -x``). None: nginx on PATH, else /usr/sbin/nginx."""
    bad_start: int = Field(ge=1)
    """The --max-num-seqs of the bad start (arm ``bad``; the tuner arms start from it)."""
    static_mode: Literal["plugin", "restart"] = "plugin"
    """How the bad start is held static: its cap on the wide-envelope engines (plugin) or engines
    started at it (restart)."""
    share_engines: bool = False
    """Run the live tuner arm first and then the plugin arms on its engines (they stay up after its tuner
    stops; each arm sets its own cap through the replicas' control directories): one pool start instead of
    two. Only when ``tuner-live`` and plugin arms are both chosen; otherwise the plugin arms get their own
    wide-envelope start, as by default."""
    sweep: Sweep
    slo: Slo = Slo()
    trace: Trace
    player: Player = Player()
    tuner: Tuner
    timings: Timings = Timings()

    def path(self, value: str, base: Path) -> Path:
        p = Path(os.path.expandvars(value)).expanduser()
        return p if p.is_absolute() else (base / p).resolve()


def load(path: str | os.PathLike[str]) -> tuple[Profile, Path]:
    """The profile and the directory its relative paths are relative to."""
    file = Path(path)
    try:
        data = yaml.safe_load(file.read_text())
    except OSError as exc:
        raise ProfileError(f"{file}: cannot read the profile ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise ProfileError(f"{file}: not valid YAML ({str(exc).splitlines()[0]})") from exc
    if not isinstance(data, dict):
        raise ProfileError(f"{file}: expected a mapping at the top level")
    try:
        return Profile.model_validate(data), file.resolve().parent
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        raise ProfileError(f"{file}: {where}: {first['msg']}{more}") from exc
