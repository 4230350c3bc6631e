"""A bench run's timeline: windows of answers, samples of replicas, its JSON form."""

import pytest

from loadtest.timeline import Timeline


def timeline_with_answers() -> Timeline:
    timeline = Timeline(start=1000.0)
    # (sent, TTFT, prompt tokens, cached tokens): two in the first 10 s, one in the third.
    timeline.add_answers(
        [
            (1001.0, 0.010, 100, 0),
            (1009.0, 0.030, 300, 200),
            (1025.0, 0.020, 200, 150),
        ]
    )
    return timeline


def test_hit_rate_is_cached_over_prompt_tokens_of_each_window():
    times, rates = timeline_with_answers().hit_rate()
    assert times == [5.0, 25.0]  # the middle of each window with answers; none in 10-20 s
    assert rates == [pytest.approx(200 / 400), pytest.approx(150 / 200)]


def test_ttft_percentiles_per_window():
    times, medians = timeline_with_answers().ttft(50)
    assert times == [5.0, 25.0]
    assert medians == [pytest.approx(0.020), pytest.approx(0.020)]


def test_no_answers_no_windows_and_no_replicas_no_sample():
    timeline = Timeline(start=0.0)
    timeline.sample(1.0, [])  # a replica did not answer: the sample is skipped whole
    assert timeline.hit_rate() == ([], []) and timeline.times == []


def test_it_round_trips_through_json():
    timeline = timeline_with_answers()
    timeline.times, timeline.outstanding = [1001.0], [[1, 2]]
    timeline.cached, timeline.in_use = [[0.5, 0.25]], [[0.1, 0.0]]
    again = Timeline.from_dict(timeline.as_dict())
    assert again == timeline
    assert list(again.seconds()) == [1.0]
