"""The offline replay's prediction beside each live row."""

from __future__ import annotations

from dataclasses import replace

from loadtest import ray_serve, sglang
from loadtest.bench.config import BenchConfig
from loadtest.bench.targets import Fleet
from loadtest.replay import replay
from loadtest.report import Row, replay_row
from loadtest.workloads import Workload, retokenized
from replica.api.model_tokenizer import load_tokenizer
from replica.api.tokenizer import DEFAULT_TOKENIZER
from router.policies import POLICIES

#: A live hit rate further than this from the replay's prediction is flagged.
REPLAY_TOLERANCE = 0.05


def predict(config: BenchConfig, fleet: Fleet, policy: str, workload: Workload) -> Row | None:
    """The offline replay of the same workload on the fleet's simulated twin."""
    twin = fleet.replay_config(config.replay_profile)
    if twin is None:
        return None
    if fleet.tokenizer[0] != DEFAULT_TOKENIZER:  # a real model's: count its tokens as it does
        workload = retokenized(workload, load_tokenizer(*fleet.tokenizer))
    if policy == sglang.LABEL:  # SGLang's router: our re-implementation of its algorithm
        policy = sglang.REPLAYED_AS
    elif ray_serve.is_serve(policy):  # a router inside Ray Serve: the policy it runs, if ours
        replayed = ray_serve.replayed_as(policy)
        if replayed is None:
            return None
        policy = replayed
    elif policy not in POLICIES:  # a label: only a lone server is predictable, any policy
        if twin.replicas > 1:
            return None
        policy = "round_robin"
    twin = replace(
        twin,
        seed=config.seed,
        session_keys=config.session_keys,
        slo_ttft_s=config.slo_ttft_s,
        slo_itl_s=config.slo_itl_s,
    )
    return replay_row(replay(workload, twin, policy))


def add_prediction(row: Row, predicted: Row | None) -> None:
    """The replay's figures beside the live ones, flagged if the hit rates part."""
    live = row.get("token_hit_rate")
    expected = predicted["token_hit_rate"] if predicted else None
    row.update(
        replay_token_hit_rate=expected,
        replay_ttft_p50_s=predicted["ttft_p50_s"] if predicted else None,
        replay_ttft_p99_s=predicted["ttft_p99_s"] if predicted else None,
        replay_imbalance=predicted["imbalance"] if predicted else None,
        replay_goodput_rps=predicted["goodput_rps"] if predicted else None,
        replay_itl_p99_s=predicted["itl_p99_s"] if predicted else None,
        replay_prompt_tokens=predicted["prompt_tokens"] if predicted else None,
        replay_differs=(
            abs(live - expected) > REPLAY_TOLERANCE
            if live is not None and expected is not None
            else None
        ),
    )
