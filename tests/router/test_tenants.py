"""API keys, tenants and cache isolation: one tenant's prompt never hits another's cache."""

import httpx
import pytest

from deploy.processes import running
from router.fair.tenants import ApiKeys, Tenant, Unauthorized, fleet_secret, tenant_salt
from tests.shared import replica_stats, wait_until_indexed

SYSTEM = "You are the assistant of a bank; account numbers follow. " * 40


def test_keys_come_from_a_file_and_the_environment(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# key tenant [admin]\nk-acme acme\nk-ops ops admin  # the operators\n\n")
    keys = ApiKeys.load(
        str(path), env={"PREFIX_ROUTER_API_KEYS": "k-globex=globex, k-root=root:admin"}
    )
    assert keys.tenant("Bearer k-acme") == Tenant("acme")
    assert keys.tenant("bearer k-globex") == Tenant("globex")
    assert keys.tenant("Bearer k-ops") == Tenant("ops", admin=True)
    keys.admin("Bearer k-root")
    for header in (None, "", "Bearer", "Basic k-acme", "Bearer k-unknown"):
        with pytest.raises(Unauthorized) as error:
            keys.tenant(header)
        assert error.value.status == 401
    with pytest.raises(Unauthorized) as error:
        keys.admin("Bearer k-acme")
    assert error.value.status == 403


def test_no_keys_means_no_authentication_and_bad_lines_are_named(tmp_path):
    assert ApiKeys.load(env={}).tenant(None) is None
    path = tmp_path / "keys"
    path.write_text("k-acme acme root\n")
    with pytest.raises(ValueError, match="keys:1"):
        ApiKeys.load(str(path), env={})


def test_no_cache_salt_can_spell_another_tenants_salt():
    assert tenant_salt(None, "s") == "s"
    # tenant "a" choosing cache_salt "b:" must not reach tenant "a:b" (or any other).
    assert tenant_salt("a", "b:") != tenant_salt("a:b", None)
    assert tenant_salt("a", None) != tenant_salt("a", "x") != tenant_salt("b", "x")


def chat(url: str, key: str | None, content: str = SYSTEM, **extra: object) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"messages": [{"role": "system", "content": content}], "max_tokens": 2, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=30)


def cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.slow
def test_a_salt_keyed_with_the_fleets_secret_cannot_be_computed_without_it(tmp_path):
    keyed = tenant_salt("acme", None, b"fleet secret")
    assert keyed == tenant_salt("acme", None, b"fleet secret")  # every gateway alike
    assert keyed != tenant_salt("acme", None)  # not the unkeyed digest anyone can spell
    assert keyed != tenant_salt("acme", None, b"another fleet")
    assert keyed != tenant_salt("globex", None, b"fleet secret")
    path = tmp_path / "secret"
    path.write_text("from a file\n")
    assert fleet_secret(str(path), env={}) == b"from a file"
    assert fleet_secret("", env={"PREFIX_ROUTER_FLEET_SECRET": "from env"}) == b"from env"
    assert fleet_secret("", env={}) == b""


def test_tenants_are_isolated_through_the_gateway(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("k-acme acme\nk-globex globex\nk-ops ops admin\n")
    with running(["replica", "--speedup", "20"]) as (replica,):
        gateway = ["gateway", f"--backend={replica}", f"--api-keys-file={keys}"]
        with running(gateway) as (url,):
            # Without a valid key: 401, naming what is wrong.
            missing, wrong = chat(url, None), chat(url, "k-nobody")
            assert missing.status_code == wrong.status_code == 401
            assert "missing API key" in missing.json()["error"]["message"]
            assert missing.headers["www-authenticate"] == "Bearer"
            # The same prompt: acme computes it, globex gets nothing from acme's cache...
            assert cached(chat(url, "k-acme")) == 0
            assert cached(chat(url, "k-globex")) == 0
            # ...while each tenant hits its own.
            assert cached(chat(url, "k-acme")) > 500
            assert cached(chat(url, "k-globex")) > 500
            # A request's cache_salt narrows sharing further, within a tenant.
            assert cached(chat(url, "k-acme", cache_salt="project-x")) == 0
            assert cached(chat(url, "k-acme", cache_salt="project-x")) > 500
            # Each tenant's footprint in the cache, from the replica's events (the same
            # prompt under three salts: acme holds it twice, globex once).
            admin = {"authorization": "Bearer k-ops"}
            wait_until_indexed(url, key="k-ops")
            footprint = httpx.get(f"{url}/stats", headers=admin).json()["tenants"]
            footprint_metrics = httpx.get(f"{url}/metrics", headers=admin).text
            cached_blocks = replica_stats(replica).cache.cached_blocks
            # Admin endpoints: a tenant's key is refused, an admin's accepted.
            policy = {"policy": "round_robin"}
            headers = {"authorization": "Bearer k-acme"}
            refused = httpx.post(f"{url}/admin/policy", json=policy, headers=headers)
            assert refused.status_code == 403
            assert httpx.post(f"{url}/admin/policy", json=policy).status_code == 401
            headers = {"authorization": "Bearer k-ops"}
            assert httpx.post(f"{url}/admin/policy", json=policy, headers=headers).is_success
            # Per-tenant figures and the topology, in /stats and in /metrics: an
            # administrator's only.
            tenants = httpx.get(f"{url}/stats", headers=headers).json()["tenants"]
            metrics = httpx.get(f"{url}/metrics", headers=headers).text
            for key in (None, "k-acme"):
                other = {"authorization": f"Bearer {key}"} if key else {}
                response = httpx.get(f"{url}/stats", headers=other)
                stats = response.json()
                assert stats["tenants"] == {} and stats["totals"]["requests"] == 6  # the rest stays
                assert stats["backends"][0]["replica_id"] == "backend-0"
                assert stats["backends"][0]["kv_stream"]["indexed_through"] > 0  # its health
                assert stats["hot_sets"] == [] and stats["tokenizer_cache"] is None
                seen = httpx.get(f"{url}/metrics", headers=other).text
                assert "prefix_router_tenant_" not in seen and "prefix_router_policy_" in seen
                assert "prefix_router_routing_decisions" not in seen
                for text in (response.text, seen):
                    assert replica.removeprefix("http://") not in text  # no address of it
    assert tenants["acme"]["requests"] == 4 and tenants["globex"]["requests"] == 2
    assert tenants["globex"]["token_hit_rate"] == pytest.approx(0.5, abs=0.05)
    assert 'prefix_router_tenant_requests_total{tenant="acme"} 4.0' in metrics
    acme, globex = footprint["acme"]["gpu_blocks"], footprint["globex"]["gpu_blocks"]
    (replica_id,) = globex
    assert acme[replica_id] == 2 * globex[replica_id] and globex[replica_id] > 30
    # the rest: the prompts the gateway probed the replica with, under no tenant
    assert cached_blocks - 16 < acme[replica_id] + globex[replica_id] < cached_blocks
    line = f'prefix_router_tenant_gpu_blocks{{replica="{replica_id}",tenant="globex"}}'
    assert f"{line} {float(globex[replica_id])}" in footprint_metrics
