"""The engine: continuous batching, the timing model, preemption, aborts, determinism."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from replica.api.cost_model import PROFILES, BatchShape, get_profile
from replica.api.tokenizer import TOKEN_DTYPE
from replica.engine import Engine, EngineConfig
from replica.scheduler import SchedulerConfig
from replica.sequence import EngineRequest
from tests.shared import Colliding, prompt

MakeEngine = Callable[..., Engine]


@pytest.fixture
def make_engine() -> Iterator[MakeEngine]:
    """Engines whose block accounting is checked when the test ends."""
    engines: list[Engine] = []

    def make(hasher_factory=None, **config) -> Engine:
        scheduler = SchedulerConfig(
            config.pop("max_num_batched_tokens", 8192), config.pop("max_num_seqs", 256)
        )
        kwargs = {"hasher_factory": hasher_factory} if hasher_factory else {}
        engine = Engine(EngineConfig(scheduler=scheduler, **config), **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.cache.check_invariants()
        if not engine.has_unfinished:
            assert engine.cache.usage == 0.0, "a finished engine still pins blocks"


def run(engine: Engine, requests: list[EngineRequest]) -> dict[str, dict]:
    """Submit together and step to the end; per request: tokens, TTFT, cached tokens."""
    start = engine.now
    results: dict[str, dict] = {r.request_id: {"tokens": [], "ttft": None} for r in requests}
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished:
        step = engine.step()
        assert step.duration_s > 0
        for out in step.outputs:
            result = results[out.request_id]
            result["ttft"] = result["ttft"] or engine.now - start
            result["tokens"] += out.new_token_ids
            result["cached"] = out.num_cached_tokens
            result["reason"] = out.finish_reason
    return results


def test_a_fully_cached_prefix_gives_a_lower_ttft_than_a_cold_one(make_engine):
    engine = make_engine(num_blocks=1024)
    system = prompt(2000)
    cold = run(engine, [EngineRequest("cold", np.concatenate((system, prompt(30, 9000))), 4)])
    warm = run(engine, [EngineRequest("warm", np.concatenate((system, prompt(30, 7000))), 4)])
    assert cold["cold"]["cached"] == 0
    assert warm["warm"]["cached"] == 2000
    assert warm["warm"]["ttft"] < cold["cold"]["ttft"] / 5


def test_a_hit_saves_exactly_the_prefill_of_the_cached_tokens(make_engine):
    engine = make_engine(num_blocks=1024)
    run(engine, [EngineRequest("a", prompt(512), 1)])
    computed_before = engine.prefill_tokens_computed
    result = run(engine, [EngineRequest("b", prompt(600), 1)])
    assert result["b"]["cached"] == 512
    assert engine.prefill_tokens_computed - computed_before == 600 - 512


def test_requests_admitted_together_with_one_new_prefix_compute_it_once(make_engine):
    """As vLLM V1: a block is cached when the step that fills it is scheduled, so the
    second request, admitted in the same step, finds the first's prompt blocks."""
    engine = make_engine(num_blocks=1024)
    shared = prompt(1000, 7)
    result = run(engine, [EngineRequest("a", shared, 2), EngineRequest("b", shared.copy(), 2)])
    assert (result["a"]["cached"], result["b"]["cached"]) == (0, 992)
    assert engine.prefill_tokens_computed == 1000 + 8
    assert result["a"]["ttft"] == result["b"]["ttft"]  # one step computed both


def test_a_prompt_longer_than_a_step_is_shared_chunk_by_chunk(make_engine):
    engine = make_engine(num_blocks=1024, max_num_batched_tokens=512)
    shared = prompt(1500, 3)
    result = run(engine, [EngineRequest("a", shared, 1), EngineRequest("b", shared.copy(), 1)])
    assert result["b"]["cached"] == 1488  # admitted beside a's last chunk: every full block
    assert engine.prefill_tokens_computed == 1500 + 12


def test_at_least_one_prompt_token_is_always_computed(make_engine):
    engine = make_engine(num_blocks=64)
    run(engine, [EngineRequest("a", prompt(64), 1)])
    again = run(engine, [EngineRequest("b", prompt(64), 1)])
    assert again["b"]["cached"] == 48  # 4 full blocks, the last one recomputed for its logits


def test_outputs_stop_at_max_tokens_or_eos(make_engine):
    engine = make_engine(num_blocks=256, eos_probability=1.0)
    results = run(
        engine,
        [
            EngineRequest("eos", prompt(10), 50),
            EngineRequest("len", prompt(10), 7, ignore_eos=True),
        ],
    )
    assert results["eos"]["reason"] == "stop" and results["eos"]["tokens"] == [0]
    assert results["len"]["reason"] == "length" and len(results["len"]["tokens"]) == 7


def test_chunked_prefill_respects_the_token_budget(make_engine):
    engine = make_engine(num_blocks=512, max_num_batched_tokens=256)
    engine.add_request(EngineRequest("long", prompt(1000), 2))
    engine.add_request(EngineRequest("short", prompt(10, 5000), 2))
    shapes = []
    while engine.has_unfinished:
        step = engine.step()
        shapes.append(step.batch)
    assert all(s.prefill_tokens + s.decode_seqs <= 256 for s in shapes)
    assert sum(s.prefill_tokens for s in shapes) == 1010
    assert shapes[0].prefill_tokens == 256  # the long prompt took the whole first step


def test_running_requests_are_capped(make_engine):
    engine = make_engine(num_blocks=512, max_num_seqs=3)
    for i in range(8):
        engine.add_request(EngineRequest(f"r{i}", prompt(20, 100 * i), 5))
    while engine.has_unfinished:
        engine.step()
        assert engine.num_running <= 3


def test_decode_tokens_get_blocks_and_full_output_blocks_are_cached(make_engine):
    engine = make_engine(num_blocks=64)
    engine.add_request(EngineRequest("r", prompt(10), 40, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    # 10 + 40 tokens; the last sampled token is never computed: 49 tokens, 3 full blocks.
    assert engine.cache.num_cached_blocks == 3


def test_preemption_and_recompute_keep_every_output_complete(make_engine):
    requests = [
        EngineRequest(f"r{i}", prompt(60, 1000 * i), 100, ignore_eos=True) for i in range(6)
    ]
    roomy = run(make_engine(num_blocks=1024), requests)
    tight_engine = make_engine(num_blocks=40)  # 640 tokens for 6 x 160: must preempt
    tight = run(tight_engine, requests)
    assert tight_engine.scheduler.num_preemptions > 0
    for request in requests:
        assert len(tight[request.request_id]["tokens"]) == 100
        assert tight[request.request_id]["tokens"] == roomy[request.request_id]["tokens"]


def test_aborting_frees_every_block(make_engine):
    engine = make_engine(num_blocks=128)
    for i in range(5):
        engine.add_request(EngineRequest(f"r{i}", prompt(100, 1000 * i), 50))
    for _ in range(3):
        engine.step()
    assert engine.cache.usage > 0
    for i in range(5):
        assert engine.abort(f"r{i}")
    assert not engine.has_unfinished
    assert engine.cache.usage == 0.0
    assert not engine.abort("r0")  # unknown now


def test_the_engine_is_deterministic_for_a_seed(make_engine):
    def trial(seed: int) -> tuple[list, list]:
        engine = make_engine(num_blocks=256, seed=seed)
        for i in range(4):
            engine.add_request(EngineRequest(f"r{i}", prompt(50 + i, 10 * i), 30))
        steps = [engine.step() for _ in range(40)]
        return [s.duration_s for s in steps], [
            (o.request_id, o.new_token_ids) for s in steps for o in s.outputs
        ]

    assert trial(1) == trial(1)
    assert trial(1)[1] != trial(2)[1]


def test_a_colliding_hash_function_costs_a_miss_not_a_wrong_answer(make_engine):
    engine = make_engine(hasher_factory=Colliding, num_blocks=128)
    first = run(engine, [EngineRequest("a", prompt(64, 1), 3)])
    second = run(engine, [EngineRequest("b", prompt(64, 500), 3)])
    assert first["a"]["cached"] == 0 and second["b"]["cached"] == 0
    same = run(engine, [EngineRequest("c", prompt(64, 1), 3)])
    assert same["c"]["cached"] == 48


def test_requests_that_cannot_fit_are_rejected_up_front(make_engine):
    engine = make_engine(num_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        engine.add_request(EngineRequest("big", prompt(60), 10))
    engine.add_request(EngineRequest("ok", prompt(10), 5))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(EngineRequest("ok", prompt(10), 5))
    engine.abort("ok")


def test_invalid_requests_and_configs_are_refused():
    with pytest.raises(ValueError, match="at least one token"):
        EngineRequest("x", np.empty(0, TOKEN_DTYPE), 4)
    with pytest.raises(ValueError, match="max_tokens"):
        EngineRequest("x", prompt(3), 0)
    with pytest.raises(ValueError, match="unknown cost profile"):
        EngineConfig(profile="tpu")


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_cost_grows_with_uncached_prefill_and_with_decode_batch_and_kv(name):
    profile = get_profile(name)
    assert profile.step_time(BatchShape()) == 0.0
    small = profile.step_time(
        BatchShape(prefill_seqs=1, prefill_tokens=128, prefill_attention_pairs=128 * 64)
    )
    large = profile.step_time(
        BatchShape(prefill_seqs=1, prefill_tokens=4096, prefill_attention_pairs=4096 * 2048)
    )
    assert large > 10 * small
    one = profile.step_time(BatchShape(decode_seqs=1, decode_context_tokens=1000))
    many = profile.step_time(BatchShape(decode_seqs=64, decode_context_tokens=64_000))
    long = profile.step_time(BatchShape(decode_seqs=64, decode_context_tokens=640_000))
    assert one < many < long


def test_the_h100_profile_gives_published_orders_of_magnitude():
    profile = get_profile("llama3-8b-h100")
    prefill_2k = profile.step_time(BatchShape(1, 2048, 2048 * 1024.5))
    decode_1 = profile.step_time(BatchShape(decode_seqs=1, decode_context_tokens=512))
    assert 0.02 < prefill_2k < 0.1  # tens of ms for a 2k prompt on one H100
    assert 0.004 < decode_1 < 0.012  # single-digit ms per token, memory-bound


def test_bursts_cut_anywhere_give_the_tokens_and_times_of_single_steps(make_engine):
    """Planned bursts, each run to a different length (as the replayer cuts them), with
    requests that EOS may end: the same tokens, reasons and clock as step by step."""

    def play(burst_cuts: list[int] | None) -> tuple[dict[str, dict], float]:
        engine = make_engine(num_blocks=512, eos_probability=0.02)
        requests = [EngineRequest(f"r{i}", prompt(40, 100 * i), 80) for i in range(5)]
        requests.append(EngineRequest("long", prompt(40, 999), 120, ignore_eos=True))
        results = {r.request_id: {"tokens": [], "reason": None} for r in requests}
        for request in requests:
            engine.add_request(request)
        cuts = iter(burst_cuts or [])
        while engine.has_unfinished:
            burst = engine.plan_burst(64) if burst_cuts is not None else None
            if burst is not None:
                step = engine.run_burst(burst, min(next(cuts, 64), burst.max_steps))
            else:
                step = engine.step()
            for out in step.outputs:
                results[out.request_id]["tokens"] += out.new_token_ids
                results[out.request_id]["reason"] = out.finish_reason
        return results, engine.now

    single, single_end = play(None)
    bursts, bursts_end = play([1, 7, 3, 64, 2, 30, 5] * 10)
    assert bursts == single
    assert bursts_end == pytest.approx(single_end, rel=1e-12)
    assert {r["reason"] for r in single.values()} == {"stop", "length"}  # EOS ended some


def test_min_tokens_holds_eos_back_and_logit_bias_moves_the_toy_model(make_engine):
    """vLLM's min_tokens and logit_bias, on a model whose logits are all equal."""
    ending = make_engine(eos_probability=1.0)  # every token would be EOS but for min_tokens
    eos = ending.tokenizer.eos_token_id
    now = EngineRequest("now", prompt(40), 8)
    later = EngineRequest("later", prompt(40), 8, min_tokens=3)
    out = run(ending, [now, later])
    assert out["now"]["tokens"] == [eos]
    assert len(out["later"]["tokens"]) == 4 and out["later"]["tokens"][3] == eos
    assert eos not in out["later"]["tokens"][:3]

    engine = make_engine(eos_probability=0.0)
    word, banned = engine.tokenizer.vocabulary[7], engine.tokenizer.vocabulary[:50]
    forced = run(engine, [EngineRequest("f", prompt(40), 16, logit_bias=((word, 100.0),))])
    assert forced["f"]["tokens"] == [word] * 16
    ban = tuple((token, -100.0) for token in banned)
    free = run(engine, [EngineRequest("b", prompt(40), 200, logit_bias=ban)])
    assert not set(free["b"]["tokens"]) & set(banned) and len(set(free["b"]["tokens"])) > 100
    # EOS's logit is not raised: a token forced by +100 holds it back too, as in vLLM
    certain_end = make_engine(eos_probability=1.0)
    held = run(certain_end, [EngineRequest("h", prompt(40), 16, logit_bias=((word, 100.0),))])
    assert held["h"]["tokens"] == [word] * 16
