"""KV that moves between engines: a prefill's blocks held for its decode replica, a
peer's prefix lent and pulled, each pull timed over the peer link beside the steps."""

import numpy as np
import pytest

from replica.api.cost_model import PROFILES, RDMA200, TCP
from replica.api.identity import DEFAULT_BLOCK_SIZE, block_hashes, identity_seed
from replica.engine import Engine, EngineConfig, EngineRequest

BLOCK = DEFAULT_BLOCK_SIZE
PROMPT = (np.arange(2000) % 251 + 1).astype(np.int64)


def engine(**config) -> Engine:
    return Engine(EngineConfig(num_blocks=600, **config))


def run(engine: Engine) -> list:
    """Step ``engine`` until it is done (idling to each pull's end); its outputs."""
    outputs = []
    while engine.has_unfinished:
        result = engine.step()
        if not result.duration_s:
            engine.advance_to(engine.next_pull_s)
        outputs += [(engine.now, out) for out in result.outputs]
    return outputs


def prefilled(hold_s: float = 5.0) -> Engine:
    """An engine that has prefilled ``PROMPT`` for a remote decode (its first token)."""
    sender = engine()
    sender.add_request(EngineRequest("r/prefill", PROMPT, 1, ignore_eos=True, hold_s=hold_s))
    run(sender)
    return sender


def hashes(prompt: np.ndarray = PROMPT) -> list[int]:
    return block_hashes(prompt, BLOCK, identity_seed(EngineConfig().model))


def test_a_held_prefill_is_pulled_and_decoded_without_recomputing_it():
    sender = prefilled()
    lent = sender.lend("r/prefill", [], until_s=sender.now + 1.0)
    assert lent == len(PROMPT) // BLOCK  # every full block of the prompt
    receiver = engine()
    receiver.advance_to(sender.now)
    decode = EngineRequest(
        "r", PROMPT, 4, ignore_eos=True, pull_tokens=lent * BLOCK, prefilled_elsewhere=True
    )
    receiver.add_request(decode)
    pulled = (len(PROMPT) - 1) // BLOCK * BLOCK  # it computes the last token itself
    pull_s = PROFILES["llama3-8b-h100"].transfer_time(pulled, RDMA200)
    assert receiver.pull_end_s("r") == pytest.approx(sender.now + pull_s)
    assert receiver.num_waiting == 1 and receiver.queued_prefill_tokens == len(PROMPT) - pulled
    outputs = run(receiver)
    first = outputs[0][1]
    assert first.num_cached_tokens == pulled  # reported as cached, as vLLM does
    assert receiver.cache_stats.query_tokens == 0  # the prefill's cache counted the prompt
    assert receiver.prefill_tokens_computed == len(PROMPT) - pulled
    assert receiver.transfers.pulls == 1 and receiver.transfers.pulled_tokens == pulled
    # the pulled blocks are the receiver's now: cached, and announced as computed ones are
    assert receiver.cache.lookup(hashes()[pulled // BLOCK - 1]) is not None
    stored = [e for e in receiver.cache.events.drain() if e.kind == "stored"]
    assert sum(len(e.block_hashes) for e in stored) >= pulled // BLOCK
    cold = engine()
    cold.add_request(EngineRequest("c", PROMPT, 4, ignore_eos=True))
    cold_first = run(cold)[0][0]
    assert outputs[0][0] - sender.now < cold_first  # pull + a block of prefill < all of it


def test_a_hold_pins_the_prompt_until_it_is_pulled_or_times_out():
    sender = prefilled(hold_s=2.0)
    blocks = len(PROMPT) // BLOCK
    assert len(sender.leases) == 1 and sender.free_blocks == sender.config.num_blocks - blocks
    sender.advance_to(sender.now + 3.0)
    sender.step()  # expires it: nobody asked
    assert len(sender.leases) == 0 and sender.transfers.hold_timeouts == 1
    assert sender.free_blocks == sender.config.num_blocks  # cached, and evictable again
    assert sender.lend("r/prefill", [], until_s=sender.now + 1) == 0  # gone: a fallback


def test_a_peer_lends_the_leading_blocks_it_holds_for_the_pull():
    peer = engine()
    peer.add_request(EngineRequest("a", PROMPT[:1000], 1, ignore_eos=True))
    run(peer)
    held = 1000 // BLOCK - (1 if 1000 % BLOCK == 0 else 0)
    assert peer.lend("x/pull", hashes(), until_s=peer.now + 0.01) == held
    assert peer.transfers.lent_blocks == held
    assert peer.lend("y/pull", hashes(PROMPT[::-1].copy()), until_s=peer.now + 0.01) == 0
    peer.advance_to(peer.now + 0.02)
    peer.step()
    assert len(peer.leases) == 0 and peer.transfers.hold_timeouts == 0  # asked for: no timeout


def test_pulls_share_the_receivers_link_one_after_another():
    receiver = engine(peer_link="tcp")
    other = (PROMPT + 7).astype(np.int64)
    for request_id, prompt in (("a", PROMPT), ("b", other)):
        receiver.add_request(EngineRequest(request_id, prompt, 1, pull_tokens=1984))
    one = PROFILES["llama3-8b-h100"].transfer_time(1984, TCP)
    assert receiver.pull_end_s("a") == pytest.approx(one)
    assert receiver.pull_end_s("b") == pytest.approx(2 * one)


def test_a_second_request_of_a_prefix_being_pulled_waits_for_the_pull():
    """Two requests of one prompt sent to a replica together, the first pulling its
    prefix: the second neither computes nor pulls what is arriving (before, it
    computed the whole prompt in the step the pulled request joined, and both waited)."""
    receiver = engine()
    receiver.add_request(EngineRequest("a", PROMPT, 1, pull_tokens=1984))
    receiver.add_request(EngineRequest("b", PROMPT, 1))
    assert receiver.pull_end_s("b") == receiver.pull_end_s("a")
    assert receiver.num_waiting == 2
    assert receiver.queued_prefill_tokens == 2 * (len(PROMPT) - 1984)
    run(receiver)
    assert receiver.transfers.pulls == 1 and receiver.transfers.pulled_tokens == 1984
    assert receiver.prefill_tokens_computed == 2 * (len(PROMPT) - 1984)


def test_a_request_waiting_for_an_aborted_pull_computes_its_prompt():
    receiver = engine()
    receiver.add_request(EngineRequest("a", PROMPT, 1, pull_tokens=1984))
    receiver.add_request(EngineRequest("b", PROMPT, 1))
    assert receiver.abort("a")
    run(receiver)
    assert receiver.prefill_tokens_computed == len(PROMPT)  # nothing arrived for it
    assert receiver.cache.stats.hit_tokens == 0


def test_a_pull_runs_beside_the_decodes_of_the_batch():
    """The decode steps go on while a pull is under way: no decode waits for it."""
    receiver = engine(peer_link="tcp")  # a slow link: a pull of 85 ms
    receiver.add_request(EngineRequest("d", PROMPT[:100], 40, ignore_eos=True))
    receiver.step()  # its prefill
    receiver.add_request(EngineRequest("p", PROMPT, 1, ignore_eos=True, pull_tokens=1984))
    steps = []
    while receiver.pull_end_s("p") is not None:
        result = receiver.step()
        steps.append(result.duration_s)
    assert len(steps) > 5 and max(steps) < 0.02  # decode steps only, the pull beside them
    assert receiver.num_running == 1


def test_aborting_a_request_while_it_pulls_frees_nothing_and_forgets_it():
    receiver = engine()
    receiver.add_request(EngineRequest("p", PROMPT, 1, pull_tokens=1984))
    assert receiver.abort("p") and not receiver.has_unfinished
    assert receiver.next_pull_s is None


def test_a_peers_pulled_prefix_counts_as_a_hit_of_the_fleets_caches():
    peer = engine()
    peer.add_request(EngineRequest("a", PROMPT, 1, ignore_eos=True))
    run(peer)
    lent = peer.lend("b/pull", hashes(), until_s=peer.now + 1)
    receiver = engine()
    receiver.add_request(EngineRequest("b", PROMPT, 1, ignore_eos=True, pull_tokens=lent * BLOCK))
    run(receiver)
    stats = receiver.cache_stats
    pulled = (len(PROMPT) - 1) // BLOCK * BLOCK
    assert stats.query_tokens == len(PROMPT) and stats.hit_tokens == stats.pulled_tokens == pulled
