"""Issue 24 item 7: `gpudiag fleet` against a Prometheus (or an impostor) that lies.

A small stand-in for Prometheus's query API answers each PromQL expression the fleet asks
(tests/test_fleet.py runs the real Prometheus for the honest cases). A redirect to another
origin must not carry the credentials; NaN, Inf or a missing time must make a node unknown,
never ready; the JSON output stays JSON.
"""

from __future__ import annotations

import http.server
import json
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.host import clean_env, run_gpudiag

NODE = {"instance": "node1:9477", "job": "gpudiag"}
NOW = 1_800_000_000.0


def _vector(samples: list[tuple[dict[str, str], str]]) -> bytes:
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": m, "value": [NOW, v]} for m, v in samples]}}).encode()


def healthy_node(now: str = str(NOW), scraped: str = str(NOW - 5), free: str = "8",
                 busy: str = "0") -> Callable[[str], bytes]:
    """Answers for one node; each argument is the sample text Prometheus would send."""
    def answer(expr: str) -> bytes:
        if expr == "vector(time())":
            return _vector([({}, now)] if now else [])
        if expr.startswith(("last_over_time(up", "up{")):
            return _vector([(NODE, "1")])
        if expr.startswith("timestamp(gpudiag_ready"):
            return _vector([(NODE, scraped)])
        if expr.startswith("gpudiag_backend_ready"):
            return _vector([({**NODE, "backend": "cuda"}, "1")])
        if expr.startswith("count by (instance) ((gpudiag_gpu_healthy"):
            return _vector([(NODE, free)])
        if expr.startswith("count by (instance) (gpudiag_gpu_occupancy"):
            return _vector([(NODE, busy)])
        if expr.startswith("gpudiag_backend_last_proven"):
            return _vector([({**NODE, "backend": "cuda"}, str(NOW - 10))])
        return _vector([])
    return answer


class _Server:
    """One stand-in HTTP server; ``route(path, headers)`` -> (status, headers, body)."""

    def __init__(self, route: Callable[[str, dict[str, str]], tuple[int, dict[str, str], bytes]]
                 ) -> None:
        self.seen: list[dict[str, str]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.seen.append(dict(self.headers))
                status, headers, body = route(self.path, dict(self.headers))
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _prometheus(answer: Callable[[str], bytes]) -> Callable[..., tuple[int, dict[str, str],
                                                                     bytes]]:
    def route(path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query).get("query", [""])[0]
        return 200, {"Content-Type": "application/json"}, answer(query)
    return route


@pytest.fixture
def servers() -> Iterator[list[_Server]]:
    made: list[_Server] = []
    yield made
    for s in made:
        s.close()


def _fleet(url: str, tmp_path: Path, *extra: str) -> tuple[int, Any, str]:
    token = tmp_path / "token"
    token.write_text("tok-SECRET\n")
    proc = run_gpudiag(["fleet", "--prometheus", url, "--bearer-token-file", str(token),
                        "--format", "json", *extra], clean_env())
    data = None
    if proc.stdout.strip():
        def no_nan(text: str) -> None:
            raise AssertionError(f"{text} in the JSON output")
        data = json.loads(proc.stdout, parse_constant=no_nan)
    return proc.returncode, data, proc.stderr


def test_a_redirect_to_another_origin_never_carries_the_token(servers: list[_Server],
                                                             tmp_path: Path) -> None:
    elsewhere = _Server(_prometheus(healthy_node()))
    servers.append(elsewhere)

    def redirect(path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        if path.startswith("/same/"):  # a same-origin redirect keeps the credentials
            return 302, {"Location": elsewhere.url + path.removeprefix("/same")}, b""
        return 302, {"Location": f"{first.url}/same{path}"}, b""

    first = _Server(redirect)
    servers.append(first)
    code, data, err = _fleet(first.url, tmp_path)
    assert code == 0, err  # the answer from the other origin is still used
    assert data["nodes"][0]["ready"] is True
    assert all(h.get("Authorization") == "Bearer tok-SECRET" for h in first.seen), first.seen
    assert elsewhere.seen and not any("Authorization" in h for h in elsewhere.seen)


@pytest.mark.parametrize("case", [
    {"now": "NaN"}, {"now": ""}, {"now": "+Inf"},
    {"scraped": "NaN"}, {"scraped": str(NOW - 100000), "now": str(NOW)},
    {"free": "NaN"}, {"free": "+Inf"}, {"busy": "-Inf"}, {"free": "2.5"},
], ids=["time NaN", "time missing", "time Inf", "scrape NaN", "100000 s stale", "free NaN",
        "free Inf", "busy -Inf", "free fractional"])
def test_non_finite_or_missing_values_make_a_node_unknown_never_ready(
        servers: list[_Server], tmp_path: Path, case: dict[str, str]) -> None:
    prom = _Server(_prometheus(healthy_node(**case)))
    servers.append(prom)
    code, data, err = _fleet(prom.url, tmp_path)
    assert code == 1, err  # none can run it: not 0 (believed), not 3 (crashed)
    node = data["nodes"][0]
    assert node["state"] == "unknown" and node["ready"] is False, node
    assert "internal error" not in err


def test_a_blocked_node_s_reason_is_its_blocker_s_not_an_unproven_backend(
        servers: list[_Server], tmp_path: Path) -> None:
    healthy = healthy_node()

    def lost(expr: str) -> bytes:
        if expr.startswith("gpudiag_blocker"):
            return _vector([({**NODE, "code": "gpu_lost", "layer": "device"}, "1")])
        if expr.startswith("gpudiag_backend_ready"):
            return _vector([({**NODE, "backend": "cuda"}, "1"),
                            ({**NODE, "backend": "jax"}, "0")])
        return healthy(expr)

    prom = _Server(_prometheus(lost))
    servers.append(prom)
    code, data, err = _fleet(prom.url, tmp_path, "--require", "jax")
    assert code == 1, err
    node = data["nodes"][0]
    assert node["gpu_validation_blocker"] == "gpu_lost"
    assert node["reason"].startswith("gpu_lost: "), node["reason"]
    assert "jax not proven on this node now" in node["reason"]
    text = run_gpudiag(["fleet", "--prometheus", prom.url, "--require", "jax"], clean_env())
    assert "gpu_lost: " in text.stdout, text.stdout
