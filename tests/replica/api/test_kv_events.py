"""The KV-event codec: what a replica encodes, a router decodes to the same events."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replica.api.kv_events import KVEvent, KVEventPage, decode_page, encode_page
from replica.engine import Engine, EngineConfig, EngineRequest
from tests.shared import prompt

hashes = st.lists(st.integers(0, 2**64 - 1), max_size=8).map(tuple)
events = st.builds(
    KVEvent,
    seq=st.integers(1, 2**40),
    kind=st.sampled_from(["stored", "removed", "cleared"]),
    block_hashes=hashes,
    parent_hash=st.none() | st.integers(0, 2**64 - 1),
    block_depths=st.lists(st.integers(0, 10_000), max_size=8).map(tuple),
)
pages = st.builds(
    KVEventPage,
    events=st.lists(events, max_size=5).map(tuple),
    last_seq=st.integers(0, 2**40),
    lost=st.booleans(),
    block_size=st.none() | st.integers(1, 256),
)


@given(pages)
def test_every_page_survives_the_round_trip(page):
    assert decode_page(encode_page(page)) == page


def test_an_engines_own_events_round_trip_in_order():
    engine = Engine(EngineConfig(num_blocks=8, block_size=4))
    engine.add_request(EngineRequest("a", prompt(20), 1))
    while engine.has_unfinished:
        engine.step()
    engine.add_request(EngineRequest("b", prompt(30, 1000), 1))  # evicts a's blocks
    while engine.has_unfinished:
        engine.step()
    logged, lost = engine.cache.events_since(0)
    page = decode_page(encode_page(KVEventPage(tuple(logged), engine.cache.last_event_seq, lost)))
    assert {e.kind for e in page.events} == {"stored", "removed"}
    assert list(page.events) == logged
    assert [e.seq for e in page.events] == list(range(1, len(logged) + 1))


def test_fields_our_events_add_are_optional_for_other_engines():
    page = decode_page(
        b'{"events": [{"seq": 3, "kind": "removed", "block_hashes": [7]}], "last_seq": 3}'
    )
    assert page == KVEventPage((KVEvent(3, "removed", (7,)),), 3, lost=False, block_size=None)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"events": [{"seq": 1, "kind": "evicted"}], "last_seq": 1}', "kind"),
        (b'{"events": [], "last_seq": "soon"}', "last_seq"),
        (b'{"events": [{"kind": "stored"}], "last_seq": 1}', "seq"),
        (b"not json", "json"),
    ],
)
def test_a_malformed_page_is_refused_naming_the_field(body, field):
    with pytest.raises(ValueError, match=field):
        decode_page(body)
