"""The crossover experiment: short prompts recompute, long ones load, and the engine agrees."""

import pytest

from loadtest.crossover import LENGTHS, costs, crossover
from prefix_router.cli import main
from replica.api.cost_model import LINKS, PROFILES


@pytest.mark.parametrize("link", LINKS.values(), ids=list(LINKS))
@pytest.mark.parametrize("profile", PROFILES.values(), ids=list(PROFILES))
def test_loading_wins_exactly_from_the_crossover_on(profile, link):
    point = crossover(profile, link)
    assert 16 < point < 4096  # the chapter's answer: it depends on prompt length
    for tokens in (n for n in LENGTHS if n >= 16):
        case = costs(profile, link, tokens, 16)
        assert case.load_wins == (tokens >= point), tokens
        # The engine, deciding request by request, flips at the same length.
        held = (tokens - 1) // 16 * 16
        assert profile.load_beats_recompute(held, 0, tokens - held, link) == (tokens >= point)


def test_a_faster_link_never_moves_the_crossover_later():
    for profile in PROFILES.values():
        assert crossover(profile, LINKS["pcie5"]) <= crossover(profile, LINKS["pcie4"])


def test_the_command_prints_the_table_and_writes_the_chart(tmp_path, capsys):
    assert main(["crossover", "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert all(name in table for name in PROFILES) and "crossover (tokens)" in table
    assert (tmp_path / "crossover.png").stat().st_size > 10_000
    assert "crossover.png" in (tmp_path / "crossover.md").read_text()
