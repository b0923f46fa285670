"""``recommend --format production-stack``: a plan as a diff of vLLM production-stack's Helm values.

For GitOps users who want no actuator at all: the change goes into the chart's values through review, and
Helm rolls the Deployment. production-stack renders each ``servingEngineSpec.modelSpec[]`` entry's
``vllmConfig`` into vLLM's command line (helm/templates/deployment-vllm-multi.yaml): ``maxNumSeqs`` →
``--max-num-seqs``, ``maxModelLen``, ``gpuMemoryUtilization``, ``tensorParallelSize``, ``dtype``,
``enableChunkedPrefill`` and ``enablePrefixCaching`` (both rendered on or off), and every other flag from the
``extraArgs`` list. The output is a diff, not a values file to pass with ``-f``: ``modelSpec`` is a list, and
Helm replaces lists rather than merging them, so a partial file would drop the other models.
"""

from __future__ import annotations

from collections.abc import Sequence

from tuner.model import knobs

# vLLM flag → production-stack vllmConfig key (what deployment-vllm-multi.yaml renders)
VLLM_CONFIG_KEYS = {
    "--max-num-seqs": "maxNumSeqs",
    "--max-model-len": "maxModelLen",
    "--gpu-memory-utilization": "gpuMemoryUtilization",
    "--tensor-parallel-size": "tensorParallelSize",
    "--dtype": "dtype",
    "--enable-chunked-prefill": "enableChunkedPrefill",
    "--enable-prefix-caching": "enablePrefixCaching",
}


def _yaml(value: knobs.Value | str | None) -> str:
    if value is None:
        return "null"
    return value if isinstance(value, str) else knobs.format_value(value)


def values_diff(changes: Sequence[tuple[str, knobs.Value | None, knobs.Value]], *, model: str,
                before: knobs.EngineArgs, after: knobs.EngineArgs) -> list[str]:
    """The lines of the diff for ``changes`` ((flag, from, to), as the plan has them) to the model spec
    named ``model``; ``before``/``after``: the whole command line, for the ``extraArgs`` list."""
    if not changes:
        return [f"# servingEngineSpec.modelSpec[name={model}]: no change"]
    lines = [f"# servingEngineSpec.modelSpec[name={model}].vllmConfig — apply by hand or in review; Helm then",
             "# rolls the Deployment (a restart of every replica, by the Deployment's own strategy)"]
    extra = [c for c in changes if knobs.normalize_flag(c[0]) not in VLLM_CONFIG_KEYS]
    for flag, old, new in changes:
        key = VLLM_CONFIG_KEYS.get(knobs.normalize_flag(flag))
        if key is None:
            continue
        if old is not None:
            lines.append(f"-  {key}: {_yaml(old)}")
        lines.append(f"+  {key}: {_yaml(new)}")
    if extra:
        flags = {knobs.normalize_flag(f) for f, _, _ in extra}
        lines.append("# extraArgs (the whole list is replaced: keep your other entries)")
        lines += [f"-  extraArgs: {_args(before, flags)}", f"+  extraArgs: {_args(after, flags)}"]
    return lines


def _args(args: knobs.EngineArgs, flags: set[str]) -> str:
    """The flags of ``flags`` as ``extraArgs`` entries (``--flag=value`` each, quoted)."""
    words = []
    for flag in sorted(flags):
        value = args.get(flag)
        if value is None:
            continue
        words.append(f'"{flag}"' if value is True else f'"{flag}={value}"')
    return "[" + ", ".join(words) + "]"
