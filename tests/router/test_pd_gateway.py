"""The gateway in front of a disaggregated fleet of real replica processes: a request
prefilled on the prefill replica and decoded on a decode replica that pulls its KV, as
vLLM's P/D proxies send it; a conversation's next turn prefilled in place; the
dashboard's pools."""

import threading
import time

import httpx
import openai
import pytest
from selenium.webdriver.common.by import By

from deploy.processes import running
from tests.router.dashboard.page import cell, refreshed_after, shown
from tests.shared import gateway_stats, replica_stats, wait_for

pytestmark = pytest.mark.slow

SYSTEM = "You summarise the documents people send. " * 60  # bytes4: ~600 tokens
DOCUMENT = " ".join(f"clause{i}" for i in range(1500))  # ~2,500 tokens


@pytest.fixture(scope="module")
def fleet():
    replica = ["replica", "--speedup", "1", "--num-blocks", "4096"]  # a decode lasts
    roles = (["--role", "prefill"], ["--role", "decode"])
    with running(*(replica + role for role in roles)) as replicas:
        backends = [f"--backend={url}" for url in replicas]
        gateway = ["gateway", *backends, "--policy", "pd_conditional"]
        with running(gateway) as (url,):
            yield url, replicas


def chat(url: str, messages: list[dict], stream: bool = False, **body) -> httpx.Response:
    body = {
        "model": "sim-llama3-8b",
        "messages": messages,
        "max_tokens": 8,
        "ignore_eos": True,
        "stream": stream,
        **body,
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def beside_a_decode(url: str, decode: str, messages: list[dict]) -> httpx.Response:
    """``messages`` sent while a short chat decodes on the decode replica (a long
    prefill there would stall it: the policy prefills it apart)."""
    short = [{"role": "user", "content": "Say a lot."}]
    busy = threading.Thread(target=chat, args=(url, short), kwargs={"max_tokens": 800})
    busy.start()
    wait_for(lambda: replica_stats(decode).running == 1, what="a decode running")
    answer = chat(url, messages)
    busy.join()
    return answer


def test_a_long_new_prompt_is_prefilled_apart_and_its_kv_pulled_by_the_decode_replica(fleet):
    url, (prefill, decode) = fleet
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Summarise: " + DOCUMENT},
    ]
    answer = beside_a_decode(url, decode, messages)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-prefix-router-prefill"] == prefill
    assert answer.headers["x-prefix-router-replica"] == decode
    body = answer.json()
    assert body["choices"][0]["message"]["content"] and "kv_transfer_params" not in body
    pulled = replica_stats(decode).transfers
    assert pulled.pulls >= 1 and pulled.pull_fallbacks == 0
    assert replica_stats(prefill).transfers.lent_blocks * 16 >= pulled.pulled_tokens > 2000
    stats = gateway_stats(url)
    assert stats.paths.get("disaggregated", 0) >= 1 and stats.paths.get("local", 0) >= 1
    assert {b.role for b in stats.backends} == {"prefill", "decode"}
    metrics = httpx.get(f"{url}/metrics").text
    assert 'prefix_router_requests_by_path_total{path="disaggregated"}' in metrics
    assert f'prefix_router_backend_role{{replica="{prefill}",role="prefill"}} 1.0' in metrics
    # the next turn finds the conversation on its decode replica: prefilled in place
    messages += [body["choices"][0]["message"], {"role": "user", "content": "And briefly?"}]
    follow = chat(url, messages, stream=True)
    assert follow.status_code == 200
    assert follow.headers["x-prefix-router-replica"] == decode
    assert "x-prefix-router-prefill" not in follow.headers
    assert "data: [DONE]" in follow.text


def test_the_official_client_streams_a_disaggregated_answer(fleet):
    url, _ = fleet
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="sim-llama3-8b",
        messages=[{"role": "user", "content": "Read this: " + DOCUMENT.replace("clause", "item")}],
        max_tokens=6,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text  # decoded wherever the seconds said, streamed through the gateway


def test_the_dashboard_shows_the_pools_their_transfers_and_the_paths(fleet, browser):
    url, (prefill, decode) = fleet
    messages = [{"role": "user", "content": "Summarise: " + DOCUMENT.replace("clause", "rule")}]
    answer = beside_a_decode(url, decode, messages)
    assert answer.headers.get("x-prefix-router-prefill") == prefill  # disaggregated
    browser.get(f"{url}/dashboard")
    refreshed_after(browser, time.time())
    assert browser.find_element(By.ID, "pools-section").is_displayed()
    stats = gateway_stats(url)
    roles = {b.role: b.replica_id for b in stats.backends}
    shown_pools = browser.execute_script(
        "return [...document.querySelectorAll('#pools tbody tr')].map(r => r.dataset.pool);"
    )
    assert shown_pools == ["prefill", "decode"]  # the way a disaggregated request goes
    for role, replica_url in (("prefill", prefill), ("decode", decode)):
        row = f'#pools tr[data-pool="{role}"]'
        moved = replica_stats(replica_url).transfers
        assert cell(browser, row, "replicas")[1] == roles[role]
        assert cell(browser, row, "pulls")[1] == str(moved.pulls)
        assert cell(browser, row, "lent_blocks")[1] == str(moved.lent_blocks)
        assert cell(browser, row, "pull_fallbacks")[1] == str(moved.pull_fallbacks)
    assert int(cell(browser, '#pools tr[data-pool="decode"]', "pulls")[1]) >= 1
    assert int(cell(browser, '#pools tr[data-pool="prefill"]', "lent_blocks")[1]) > 0
    for path, count in stats.paths.items():
        assert shown(browser, f'#paths [data-field="{path}"]')[1] == str(count)
    assert stats.paths["disaggregated"] >= 1
