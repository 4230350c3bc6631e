"""`prefix-router calibrate` against a live server: our simulated replica, run at a
profile whose terms are known, must have them recovered from its HTTP answers alone."""

import asyncio
import json
import shlex
from dataclasses import replace

import aiohttp
import pytest
from aiohttp import web

from deploy.processes import running
from loadtest.calibrate import Server
from prefix_router.cli import main
from replica.api.cost_model import PROFILES, StepCosts, get_profile
from replica.api.fleet_token import ENV_FLEET_TOKEN
from tests.shared import http_server, prefix_router

pytestmark = pytest.mark.slow

TOKEN = "the-fleets-token"

#: Known terms, large enough to stand out of a loaded machine's HTTP noise.
KNOWN = StepCosts(step_s=10e-3, seq_s=2e-3, token_s=50e-6, attention_pair_s=40e-9)


def test_calibrate_recovers_a_simulated_replicas_terms_and_writes_a_profile(tmp_path):
    known = tmp_path / "known.json"
    replace(PROFILES["llama3-8b-h100"], name="known", costs=KNOWN, kv_tokens=65536).save(known)
    out = tmp_path / "calibrated"
    token = tmp_path / "fleet-token"
    token.write_text(TOKEN)
    # a fleet's replica, that answers only the fleet's token
    with running(["replica", "--profile", str(known)], env={ENV_FLEET_TOKEN: TOKEN}) as (url,):
        done = prefix_router(
            "calibrate",
            "--backend",
            url,
            "--fleet-token-file",
            str(token),
            *shlex.split(
                "--prompt-lengths 128,512,1024,2048 --cached-fractions 0,0.5 --batch-sizes 1,4,8 "
                "--decode-contexts 128,512 --decode-tokens 16 --repeats 3"
            ),
            "--out",
            str(out),
        )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "calibrate: 100%" in done.stderr  # the progress bar
    fitted = get_profile(str(out / "profile.json"))
    # The step's overhead comes out a little above what the engine sleeps: its own loop
    # and the HTTP stream run on top. The linear and attention terms trade a little: up
    # to 2,048 tokens, a prompt's attention is a large enough share of its prefill to be
    # told apart from its linear layers on a busy machine (up to 1,024, 0.70-1.05x of the
    # known term in five runs beside three busy processes; 0.94-1.10x with 2,048 added).
    # Each point is the median of three repeats, so that one busy moment of a shared
    # machine does not move it; a busy stretch still can, by a fifth or so.
    assert fitted.costs.step_s == pytest.approx(KNOWN.step_s, rel=0.15)
    assert fitted.costs.seq_s == pytest.approx(KNOWN.seq_s, rel=0.15)
    assert fitted.costs.token_s == pytest.approx(KNOWN.token_s, rel=0.25)
    assert fitted.costs.attention_pair_s == pytest.approx(KNOWN.attention_pair_s, rel=0.3)
    assert fitted.kv_tokens == 65536 and fitted.name == "calibrated-sim-llama3-8b"
    assert "median" in done.stdout and "| step_s |" in done.stdout
    table = (out / "calibration.md").read_text()
    assert table.count("| prefill ") == 8 and table.count("| decode ") == 6
    assert (out / "calibration.png").stat().st_size > 10_000

    # The profile drives the replayer as a built-in one does.
    replayed = prefix_router(
        "replay",
        "--profile",
        str(out / "profile.json"),
        *shlex.split("--replicas 2 --chat-num-sessions 20 --policies cache_aware --no-progress"),
        "--json",
        str(tmp_path / "replay.json"),
    )
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    rows = json.loads((tmp_path / "replay.json").read_text())["rows"]
    assert rows[0]["capacity_blocks"] == 65536 // 16


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--backend", "127.0.0.1:8000"], "needs http://"),
        (["--backend", "http://127.0.0.1:9", "--batch-sizes", "4"], "two sizes"),
        (["--backend", "http://127.0.0.1:9"], "cannot reach http://127.0.0.1:9"),
    ],
)
def test_calibrate_says_what_it_cannot_do(capsys, args, says):
    assert main(["calibrate", *args, "--no-progress"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("prefix-router calibrate: error: ") and says in line


def test_a_server_that_does_not_report_its_cached_tokens_is_named():
    """A server whose usage has no ``cached_tokens`` (vLLM without
    --enable-prompt-tokens-details): a cached fraction cannot be measured, and says so."""

    async def complete(request: web.Request) -> web.StreamResponse:
        answer = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await answer.prepare(request)
        await answer.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        await answer.write(b'data: {"choices": [], "usage": {"prompt_tokens": 9}}\n\n')
        await answer.write(b"data: [DONE]\n\n")
        return answer

    async def main() -> None:
        async with (
            http_server("/v1/completions", complete) as url,
            aiohttp.ClientSession() as session,
        ):
            server = Server(session, url, "m", seed=0)
            alone = await server.prefill(64, 0.0, 2048)
            assert alone.cached == 0 and alone.ttft_s > 0
            with pytest.raises(ValueError, match="enable-prompt-tokens-details"):
                await server.prefill(64, 0.5, 2048)

    asyncio.run(main())
