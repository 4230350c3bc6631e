"""The gateway's rewrite of a body it forwards: fields appended, read back as if merged."""

import json

from hypothesis import given
from hypothesis import strategies as st

from router.path.resolve import rewritten

values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=8,
)
bodies = st.dictionaries(st.sampled_from(["model", "cache_salt", "stream_options", "x"]), values)


@given(
    body=bodies,
    fields=st.dictionaries(st.sampled_from(["cache_salt", "y"]), values),
    usage=st.booleans(),
    indent=st.sampled_from([None, 2]),
    tail=st.sampled_from(["", " \n"]),
)
def test_a_rewritten_body_reads_as_the_merge_of_the_body_and_the_fields(
    body, fields, usage, indent, tail
):
    raw = (json.dumps(body, indent=indent) + tail).encode()
    expected = {**body, **fields}
    if usage:
        expected["stream_options"] = {"include_usage": True}
    assert json.loads(rewritten(raw, usage, fields)) == expected


def test_nothing_to_change_forwards_the_bytes_as_they_came():
    raw = b'{"model": "m",  "prompt": "hi"}'
    assert rewritten(raw, False, {}) is raw
    # a client's own cache_salt, even twice, loses to the tenant's
    twice = b'{"cache_salt": "a", "cache_salt": "b"}'
    assert json.loads(rewritten(twice, False, {"cache_salt": "tenant"})) == {"cache_salt": "tenant"}
