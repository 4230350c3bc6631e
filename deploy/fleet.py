"""A fleet of several models: ``--fleet MODEL=N[:ADAPTER,ADAPTER...]``, repeatable.

``serve`` and ``up`` start N replicas of each entry, in order (``replica-0`` ...):
each serves its model and, for the simulated engine, those LoRA adapters (vLLM's
take ``--engine-arg='--enable-lora --lora-modules NAME=PATH'``). Without ``--fleet``,
``--replicas`` replicas serve ``--model``. The gateway in front routes each request
among the replicas of its model (``router/fleet/models.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from deploy.engines import deployment_of
from deploy.replicas import EngineSpec
from replica.vllm_server import VLLMConfig
from router.fleet.autoscaler import AutoscaleConfig

FLEET_HELP = (
    "repeatable: N replicas serving MODEL (and, on the simulated engine, these LoRA "
    "adapters), in place of --replicas and --model: --fleet llama=2:sql,chat --fleet qwen=2"
)


@dataclass(frozen=True)
class FleetEntry:
    model: str
    replicas: int
    adapters: tuple[str, ...] = ()


def parse_entry(text: str) -> FleetEntry:
    """``MODEL=N`` or ``MODEL=N:ADAPTER,ADAPTER``; raises ``ValueError`` saying which."""
    model, sep, rest = text.rpartition("=")
    count, _, adapters = rest.partition(":")
    if not sep or not model or not count.isdigit() or int(count) < 1:
        raise ValueError(
            f"--fleet {text!r}: expected MODEL=N (N at least 1) or MODEL=N:ADAPTER,ADAPTER"
        )
    names = tuple(name for name in adapters.split(",") if name)
    if model in names:
        raise ValueError(f"--fleet {text!r}: an adapter may not be named as its model")
    return FleetEntry(model, int(count), names)


PD_HELP = (
    "a disaggregated fleet: N replicas that prefill and M that decode, in place of "
    "--replicas (route it with --policy pd_conditional, pd_always or pd_blind; vLLM's "
    "need a KV connector: --engine-arg='--kv-transfer-config ...')"
)


def fleet_engines(
    entries: Sequence[str],
    replicas: int,
    engine: EngineSpec,
    prefill: int = 0,
    decode: int = 0,
) -> list[EngineSpec]:
    """One engine per replica: ``replicas`` copies of ``engine`` without ``--fleet``,
    else each entry's count of ``engine`` serving its model (and adapters); with
    ``prefill`` or ``decode``, that many prefill replicas, then that many decode ones
    (vLLM's with the KV connector its flags give)."""
    if prefill or decode:
        return _disaggregated(entries, engine, prefill, decode)
    if not entries:
        return [engine] * replicas
    fleet = [parse_entry(text) for text in entries]
    names = [name for entry in fleet for name in (entry.model, *entry.adapters)]
    if len(set(names)) < len(names):
        raise ValueError(
            f"--fleet: every model and adapter needs a name of its own, got {', '.join(names)}"
        )
    engines: list[EngineSpec] = []
    for entry in fleet:
        engines += [_serving(engine, entry)] * entry.replicas
    return engines


def _disaggregated(
    entries: Sequence[str], engine: EngineSpec, prefill: int, decode: int
) -> list[EngineSpec]:
    if entries:
        raise ValueError("--prefill and --decode deploy one model, not a --fleet")
    if isinstance(engine, VLLMConfig) and "--kv-transfer-config" not in engine.engine_args:
        raise ValueError(
            "a disaggregated fleet of vLLM servers moves its KV through a KV connector: "
            "give it with --engine-arg='--kv-transfer-config {...}' (docs/vllm.md has one "
            "that runs on CPUs)"
        )
    if prefill < 0 or decode < 0 or not prefill + decode:
        raise ValueError("--prefill and --decode take counts, at least one of them positive")
    prefills: list[EngineSpec] = [replace(engine, role="prefill")] * prefill
    return prefills + [replace(engine, role="decode")] * decode


def _serving(engine: EngineSpec, entry: FleetEntry) -> EngineSpec:
    return deployment_of(engine).serving(engine, entry.model, entry.adapters)


def scaling_text(autoscale: AutoscaleConfig, engines: Sequence[EngineSpec]) -> str:
    """How the fleet scales, in a line: each pool apart where it has several."""
    pools = dict.fromkeys(engine.role for engine in engines)
    each = f"each pool ({', '.join(pools)}) " if len(pools) > 1 else ""
    return (
        f"autoscaling: {each}{autoscale.min_replicas} to {autoscale.max_replicas} replicas "
        f"(scale-in by {autoscale.scale_in})"
    )
