import itertools

import numpy as np
import pytest

from loadtest.bench import BenchConfig
from loadtest.workloads import (
    WORKLOADS,
    ChatConfig,
    WorkloadOptions,
    chat_workload,
    load_workload,
    retokenized,
    trace_block_tokens,
    trace_prompt,
    workload_for,
    workload_kind,
    workload_usage,
)
from replica.api.model_tokenizer import load_tokenizer
from replica.api.tokenizer import ByteTokenizer
from tests.shared import MOONCAKE_TRACE

TRACE = MOONCAKE_TRACE


def prompts(workload):
    return [t.prompt_token_ids for s in workload.sessions for t in s.turns]


def test_the_same_seed_gives_the_same_requests():
    config = ChatConfig(num_sessions=20)
    a, b = chat_workload(config), chat_workload(config)
    assert all(np.array_equal(x, y) for x, y in zip(prompts(a), prompts(b), strict=True))
    assert [s.start_time_s for s in a.sessions] == [s.start_time_s for s in b.sessions]
    other = chat_workload(ChatConfig(num_sessions=20, seed=1))
    assert not np.array_equal(prompts(a)[0], prompts(other)[0])


def test_each_turn_resends_the_whole_conversation():
    workload = chat_workload(ChatConfig(num_sessions=30, mean_turns=5))
    session = max(workload.sessions, key=lambda s: len(s.turns))
    assert len(session.turns) > 2
    for before, after in itertools.pairwise(session.turns):
        first, second = before.prompt_token_ids, after.prompt_token_ids
        assert len(second) > len(first) + after.messages[-2]["content"].count(" ")
        assert np.array_equal(second[: len(first)], first)


def test_sessions_of_one_app_share_its_system_prompt():
    workload = chat_workload(ChatConfig(num_sessions=40, num_apps=2))
    by_app: dict[int, list] = {}
    for session in workload.sessions:
        by_app.setdefault(session.app, []).append(session)
    for sessions in by_app.values():
        shared = sessions[0].shared_prefix_tokens
        heads = {
            sessions[i].turns[0].prompt_token_ids[:shared].tobytes() for i in range(len(sessions))
        }
        assert len(heads) == 1
    assert len({s.turns[0].prompt_token_ids[:100].tobytes() for s in workload.sessions}) == 2


def test_popularity_is_skewed_towards_the_first_apps():
    workload = chat_workload(ChatConfig(num_sessions=400, num_apps=4))
    counts = np.bincount([s.app for s in workload.sessions], minlength=4)
    assert counts[0] > counts[1] > counts[3]


def test_documents_and_fewshot_blocks_lengthen_prompts():
    plain = chat_workload(ChatConfig(num_sessions=20))
    rich = chat_workload(ChatConfig(num_sessions=20, fewshot_tokens=400, document_probability=1.0))
    assert (
        len(rich.sessions[0].turns[0].prompt_token_ids)
        > len(plain.sessions[0].turns[0].prompt_token_ids) + 1000
    )


def test_chat_prompts_render_every_message_and_extend_the_turn_before():
    first, second = chat_workload(ChatConfig(num_sessions=1)).sessions[0].turns[:2]
    text = ByteTokenizer().decode(first.prompt_token_ids)
    assert text.startswith("<|system|>\n") and text.rstrip().endswith("<|assistant|>")
    found = [text.find(message["content"]) for message in first.messages]
    assert -1 not in found and found == sorted(found)  # every message, in order
    # The next turn resends the history: this turn's prompt is its prefix, to the token.
    before, after = first.prompt_token_ids, second.prompt_token_ids
    assert len(after) > len(before)
    assert np.array_equal(after[: len(before)], before)


def test_trace_hash_ids_become_deterministic_runs_of_512_tokens():
    assert np.array_equal(trace_block_tokens(5), trace_block_tokens(5))
    assert not np.array_equal(trace_block_tokens(5), trace_block_tokens(6))
    tokens = trace_prompt([0, 1, 2], 1100)
    assert len(tokens) == 1100
    assert np.array_equal(tokens[512:1024], trace_block_tokens(1))


def test_the_mooncake_trace_keeps_lengths_outputs_and_timestamps():
    workload = load_workload(f"trace:{TRACE}", {"limit": 50})
    assert workload.arrival == "trace" and len(workload.sessions) == 50
    first = workload.sessions[0].turns[0]
    assert len(first.prompt_token_ids) == 6758 and first.max_tokens == 500
    assert first.timestamp_s == 0.0
    starts = [s.start_time_s for s in workload.sessions]
    assert starts == sorted(starts) and starts[-1] > 0
    heads = {s.turns[0].prompt_token_ids[:512].tobytes() for s in workload.sessions}
    assert len(heads) == 1  # every request starts with hash id 0


def test_trace_copies_are_tenants_of_their_own_shifted_in_time():
    one = load_workload(f"trace:{TRACE}", {"limit": 20})
    three = load_workload(f"trace:{TRACE}", {"limit": 20, "copies": 3, "copy_shift_s": 30.0})
    assert three.num_requests == 3 * one.num_requests and three.name.endswith(" x3")
    by_tenant: dict[str | None, list] = {}
    for session in three.sessions:
        by_tenant.setdefault(session.cache_salt, []).append(session)
    assert set(by_tenant) == {None, "copy-1", "copy-2"}
    for copy, shift in ((None, 0.0), ("copy-1", 10.0), ("copy-2", 20.0)):
        sessions = by_tenant[copy]
        for original, copied in zip(one.sessions, sessions, strict=True):
            assert copied.start_time_s == pytest.approx(original.start_time_s + shift)
            assert copied.turns[0].timestamp_s == pytest.approx(copied.start_time_s)
            assert np.array_equal(
                copied.turns[0].prompt_token_ids, original.turns[0].prompt_token_ids
            )  # the same tokens: only the tenant's salt keeps their blocks apart
    assert len({s.session_id for s in three.sessions}) == len(three.sessions)


def test_bad_workload_specs_are_explained():
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("poem")
    with pytest.raises(ValueError, match="not found"):
        load_workload("trace:/nonexistent.jsonl")
    with pytest.raises(ValueError, match="unknown trace parameters"):
        load_workload(f"trace:{TRACE}", {"copys": 2})
    with pytest.raises(ValueError, match="copies must be positive"):
        load_workload(f"trace:{TRACE}", {"copies": 0})
    with pytest.raises(ValueError, match="unknown chat parameters"):
        load_workload("chat", {"num_session": 3})
    with pytest.raises(ValueError, match="arrival"):
        ChatConfig(arrival="trace")


def test_the_registry_names_each_kind_and_what_the_commands_ask_of_it():
    assert list(WORKLOADS) == ["chat", "shared_prefix", "trace"]
    assert workload_usage() == "chat or shared_prefix or trace:PATH"
    chat, trace = workload_kind("chat"), workload_kind(f"trace:{TRACE}")
    assert chat.chat and not trace.chat
    with pytest.raises(ValueError, match="expected 'chat' or 'shared_prefix' or 'trace:PATH'"):
        workload_kind("chat:extra")  # chat takes no argument, a trace needs its path
    with pytest.raises(ValueError, match="unknown workload 'trace'"):
        workload_kind("trace")


def test_shared_prefix_is_many_groups_of_one_long_prompt_and_a_short_question():
    options = WorkloadOptions(replicas=8, sessions_per_replica=10, chat={"num_sessions": 200})
    kind = workload_kind("shared_prefix")
    assert kind.chat and not kind.scales_with_fleet(options)
    workload = workload_for("shared_prefix", options)
    assert workload.name == "shared_prefix" and workload.num_requests == 200  # one turn each
    assert len({s.app for s in workload.sessions}) > 40  # of 96 groups, mildly skewed
    lengths = [len(p) for p in prompts(workload)]
    assert min(lengths) > 4096 and max(lengths) < 4096 + 200  # the prompt, a short question
    starts = np.array([s.start_time_s for s in workload.sessions])
    first, last = np.histogram(starts, bins=2)[0]
    assert last > 1.5 * first  # the rate ramps


def test_a_load_given_per_replica_grows_with_the_fleet():
    """Chat's sessions and rate scale with the replicas unless its parameters fix them;
    a trace is copied once per ``replicas_per_copy`` replicas, else played as it is."""
    per_replica = WorkloadOptions(replicas=3, sessions_per_replica=10, rate_per_replica=2.0)
    chat = workload_kind("chat")
    assert chat.scales_with_fleet(per_replica)
    scaled = workload_for("chat", per_replica)
    alike = chat_workload(ChatConfig(num_sessions=30, session_rate=6.0))
    assert [s.start_time_s for s in scaled.sessions] == [s.start_time_s for s in alike.sessions]
    assert all(np.array_equal(a, b) for a, b in zip(prompts(scaled), prompts(alike), strict=True))
    fixed = WorkloadOptions(replicas=3, sessions_per_replica=10, chat={"num_sessions": 5})
    assert len(workload_for("chat", fixed).sessions) == 5
    spec = f"trace:{TRACE}"
    once = WorkloadOptions(replicas=4, limit=10)
    copied = WorkloadOptions(replicas=4, limit=10, replicas_per_copy=2)
    assert not workload_kind(spec).scales_with_fleet(once)
    assert workload_kind(spec).scales_with_fleet(copied)
    assert workload_for(spec, once).num_requests == 10
    assert workload_for(spec, copied).num_requests == 20


def test_a_workload_retokenized_counts_tokens_as_the_model_reads_them(tiny_model):
    """The replay of a vLLM fleet plays the prompts the model's own tokenizer and chat
    template make of the same messages; token traces stay as they are."""
    model = load_tokenizer(str(tiny_model))
    original = chat_workload(ChatConfig(num_sessions=12, num_apps=2))
    again = retokenized(original, model)
    for before, after in zip(original.sessions, again.sessions, strict=True):
        for old, new in zip(before.turns, after.turns, strict=True):
            assert np.array_equal(new.prompt_token_ids, model.apply_chat_template(new.messages))
            assert len(new.prompt_token_ids) != len(old.prompt_token_ids)
            assert new.prompt_token_ids[: after.shared_prefix_tokens].tolist() == (
                after.turns[0].prompt_token_ids[: after.shared_prefix_tokens].tolist()
            )
    shared = {s.app: s.shared_prefix_tokens for s in again.sessions}
    first = {s.app: s.turns[0].prompt_token_ids for s in again.sessions}
    for session in again.sessions:  # an app's sessions share its system prompt's tokens
        n = shared[session.app]
        assert session.shared_prefix_tokens == n > 100
        assert np.array_equal(session.turns[0].prompt_token_ids[:n], first[session.app][:n])
    trace = load_workload(f"trace:{TRACE}", {"limit": 5})
    assert retokenized(trace, model).sessions[0].turns[0] is trace.sessions[0].turns[0]


def test_the_bench_lightens_the_chat_load_but_not_a_workload_with_defaults_of_its_own():
    assert BenchConfig().chat_config()["reply_tokens"] == 120  # the bench's light chat
    shared = BenchConfig(workload="shared_prefix", chat={"num_sessions": 50})
    assert "reply_tokens" not in shared.chat_config()  # its own 400-token answers stay
    lengths = [t.max_tokens for s in shared.load().sessions for t in s.turns]
    assert len(lengths) == 50 and sum(lengths) / len(lengths) > 300
    told = BenchConfig(workload="shared_prefix", chat={"reply_tokens": 50})
    assert told.chat_config()["reply_tokens"] == 50  # the user's flag still wins
