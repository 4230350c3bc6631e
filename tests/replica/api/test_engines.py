"""The engine kinds by name: each reads its own endpoints' answers and nothing else's,
and every kind the contract knows can be deployed."""

import json

import pytest

from deploy.engines import DEPLOYMENTS
from replica.api import stats as stats_codec
from replica.api.config import ReplicaConfig
from replica.api.engines import ENGINES, SIM, VLLM, engine
from replica.api.figures import EngineFigures
from replica.service import Replica
from tests.replica.api.test_card import MODELS, VLLM_METRICS

URL = "http://h:8000"


def answers_of_each_kind() -> dict[str, dict[str, bytes]]:
    """What one of our replicas and a vLLM server answer on their paths."""
    ours = json.dumps(stats_codec.encode(Replica(ReplicaConfig(num_blocks=64)).stats())).encode()
    vllm = {"/metrics": VLLM_METRICS.encode(), "/v1/models": json.dumps({"data": MODELS}).encode()}
    return {"sim": {"/stats": ours}, "vllm": vllm}


def test_each_kind_knows_its_own_server_and_no_other():
    answers = answers_of_each_kind()
    for name, kind in ENGINES.items():
        for server, answered in answers.items():
            card = kind.card(URL, answered)
            figures = kind.figures(answered)
            if server == name:
                assert card is not None and card.engine == name and card.url == URL
                assert figures is not None
            else:
                assert card is None and figures is None, (name, server)
    card = SIM.card(URL, answers["sim"])
    assert card is not None and card.num_blocks == 64 and card.block_size == 16
    assert VLLM.figures(answers["vllm"]) == EngineFigures(2, 3004, 1472)


def test_a_kind_is_found_by_name_and_every_kind_is_deployable():
    assert engine("vllm") is VLLM and next(iter(ENGINES)) == SIM.name  # the default first
    with pytest.raises(ValueError, match="unknown engine 'sglang'; known: sim, vllm"):
        engine("sglang")
    assert set(DEPLOYMENTS) == set(ENGINES)
    assert all(d.kind is ENGINES[name] for name, d in DEPLOYMENTS.items())
