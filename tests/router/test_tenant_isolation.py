"""Tenants who cannot time each other through the gateway: every cache that a tenant's
text can warm (the tokenizer's pieces of conversations, the keys of long prompts) is
found only by the tenant that warmed it, so another tenant's request does the same work
whatever was sent before it. Counted in ``/stats`` rather than timed: the counts are
what the timing follows, and they do not flake on a busy machine."""

import httpx
import pytest

from deploy.processes import running
from tests.shared import build_hf_tokenizer, gateway_stats, replica_stats, wait_until_checked

pytestmark = pytest.mark.slow

KEYS = {"a": "key-of-tenant-a", "b": "key-of-tenant-b"}
ADMIN = "key-of-the-operator"
SYSTEM = "You are a helpful assistant for the support desk of a bicycle shop. " * 40
LONG_PROMPT = [10 + i % 290 for i in range(5000)]  # past the key cache's 4,096-token head


def send(url: str, tenant: str, body: dict) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    answer = httpx.post(url + path, json={**body, "max_tokens": 2}, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text


def test_a_tenants_text_is_tokenized_and_keyed_apart_from_another_tenants(tmp_path):
    model = str(build_hf_tokenizer(tmp_path / "model"))
    keys = tmp_path / "keys.txt"
    keys.write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    keys.write_text(keys.read_text() + f"{ADMIN} ops admin\n")
    replica = ["replica", "--tokenizer", model, "--num-blocks", "1024", "--host-blocks", "0"]
    with running(replica) as (backend,):
        gateway = ["gateway", "--tokenizer", model, f"--backend={backend}"]
        with running([*gateway, "--api-keys-file", str(keys)]) as (url,):
            wait_until_checked(url)
            chat = {
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "Hi"},
                ]
            }
            # the gateway's tokenizer, then the replica's (scoped by the tenant's salt)
            for pieces in (
                lambda: gateway_stats(url, ADMIN).tokenizer_cache,
                lambda: replica_stats(backend).tokenizer_cache,
            ):
                before = pieces()  # the pieces of the check's canary chat, or none
                send(url, "a", chat)
                first = pieces()
                send(url, "b", chat)  # the same chat: nothing of a's is found for b
                second = pieces()
                send(url, "b", chat)  # b's own pieces are
                third = pieces()
                assert before and first and second and third
                encoded_for_a = first.encoded_tokens - before.encoded_tokens
                encoded_for_b = second.encoded_tokens - first.encoded_tokens
                # b finds at most its own few words of headers (its first chat's roles)
                assert second.hit_tokens - first.hit_tokens < 20
                assert encoded_for_b > encoded_for_a - 20 > 400
                assert third.hit_tokens - second.hit_tokens > 400
                chat = {**chat, "messages": [{"role": "user", "content": "Again. " + SYSTEM}]}

            send(url, "a", {"prompt": LONG_PROMPT})
            send(url, "b", {"prompt": LONG_PROMPT})  # a's keys are not b's: hashed whole
            keyed = gateway_stats(url, ADMIN).key_cache
            assert keyed and keyed.misses == 2 and keyed.hits == 0
            send(url, "b", {"prompt": [*LONG_PROMPT, 20, 30]})
            assert gateway_stats(url, ADMIN).key_cache.hits == 1  # b's own earlier prompt
