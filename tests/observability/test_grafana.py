"""`spur dashboards push` against a loopback stand-in Grafana (no Grafana server
is obtainable from the package registries): an http.server that implements
exactly the endpoints grafana-client calls (health, data sources by uid,
folders, dashboards/db with overwrite) and answers 401 / 409 / 412 as Grafana
does, recording every body. Also: the exported files, the chart's copies, the
rule file under promtool, and `requests` still working in this environment."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from spur.cluster import dashboards as D
from spur.cluster.grafana import PushError, push

from .test_rules import fired as _fired

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "glsa_test"


class StandIn:
    """State of the stand-in Grafana: objects by uid, recorded requests, and a
    switch to answer the next dashboard post with a conflict."""

    def __init__(self) -> None:
        self.datasources: dict[str, dict[str, Any]] = {}
        self.folders: dict[str, dict[str, Any]] = {}
        self.dashboards: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str, Any]] = []
        self.conflict: int | None = None
        self.post_answer: dict[str, Any] | None = None  # replaces a dashboard post's answer


def make_handler(state: StandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _answer(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> Any:
            n = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(n)) if n else None

        def _route(self, method: str) -> None:
            body = self._body()
            state.calls.append((method, self.path, body))
            if self.path == "/api/health":
                return self._answer(200, {"database": "ok", "version": "11.1.0"})
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                return self._answer(401, {"message": "invalid API key"})
            parts = self.path.split("?")[0].strip("/").split("/")
            if parts[:3] == ["api", "datasources", "uid"] and method == "GET":
                ds = state.datasources.get(parts[3])
                return self._answer(200, ds) if ds else self._answer(404, {"message": "not found"})
            if parts[:3] == ["api", "datasources", "uid"] and method == "PUT":
                state.datasources[parts[3]] = body
                return self._answer(200, {"message": "Datasource updated"})
            if parts == ["api", "datasources"] and method == "POST":
                if any(d["name"] == body["name"] for d in state.datasources.values()):
                    return self._answer(409, {"message": "data source with the same name exists"})
                state.datasources[body["uid"]] = body
                return self._answer(200, {"message": "Datasource added", "id": 1})
            if parts[:2] == ["api", "folders"] and method == "GET" and len(parts) == 3:
                f = state.folders.get(parts[2])
                return self._answer(200, f) if f else self._answer(404, {"message": "not found"})
            if parts == ["api", "folders"] and method == "POST":
                state.folders[body["uid"]] = body
                return self._answer(200, {"uid": body["uid"], "title": body["title"]})
            if parts == ["api", "dashboards", "db"] and method == "POST":
                if state.conflict:
                    code, state.conflict = state.conflict, None
                    return self._answer(code, {"message": "version-mismatch", "status": "conflict"})
                uid = body["dashboard"]["uid"]
                if uid in state.dashboards and not body.get("overwrite"):
                    return self._answer(
                        412, {"message": "dashboard exists", "status": "name-exists"}
                    )
                version = state.dashboards.get(uid, {}).get("version", 0) + 1
                state.dashboards[uid] = {**body, "version": version}
                if state.post_answer is not None:
                    return self._answer(200, state.post_answer)
                return self._answer(200, {"status": "success", "uid": uid, "version": version})
            return self._answer(404, {"message": f"stand-in does not serve {method} {self.path}"})

        def do_GET(self) -> None:
            self._route("GET")

        def do_POST(self) -> None:
            self._route("POST")

        def do_PUT(self) -> None:
            self._route("PUT")

    return Handler


@pytest.fixture
def grafana() -> Iterator[tuple[str, StandIn]]:
    state = StandIn()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()


def test_push_creates_then_updates_in_place(grafana: tuple[str, StandIn]) -> None:
    url, state = grafana
    first = push(url, token=TOKEN, prometheus_url="http://prom:9090")
    assert first == {
        "datasource": "created",
        "folder": "created",
        "dashboards": ["spur-overview", "spur-capacity", "spur-lanes"],
    }
    ds = state.datasources[D.DATASOURCE_UID]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prom:9090"
    assert state.folders[D.FOLDER_UID]["title"] == "spur"
    for d in D.DASHBOARDS:
        sent = state.dashboards[d.uid]
        assert sent["overwrite"] is True and sent["folderUid"] == D.FOLDER_UID
        assert sent["dashboard"]["id"] is None  # matched by uid, never by a stale id
        targets = [t["expr"] for p in sent["dashboard"]["panels"] for t in p["targets"]]
        assert targets == [e for p in d.panels for e, _ in p.targets]
    second = push(url, token=TOKEN, prometheus_url="http://prom:9091")
    assert second["datasource"] == "updated" and second["folder"] == "exists"
    assert len(state.datasources) == 1 and len(state.folders) == 1 and len(state.dashboards) == 3
    assert state.datasources[D.DATASOURCE_UID]["url"] == "http://prom:9091"
    assert all(v["version"] == 2 for v in state.dashboards.values())


def test_push_errors_are_one_clear_line(grafana: tuple[str, StandIn]) -> None:
    url, state = grafana
    with pytest.raises(PushError, match=r"refused the credentials \(401\): pass --token"):
        push(url, token="wrong")
    push(url, token=TOKEN)
    state.conflict = 412
    with pytest.raises(PushError, match=r"conflict \(412: version-mismatch\)"):
        push(url, token=TOKEN)
    state.conflict = 409
    with pytest.raises(PushError, match=r"conflict \(409"):
        push(url, token=TOKEN)
    with pytest.raises(PushError, match=r"cannot reach Grafana at http://127\.0\.0\.1:9/"):
        push("http://127.0.0.1:9/", token=TOKEN, timeout_s=2)


@pytest.fixture
def web_page() -> Iterator[str]:
    """Not Grafana: 200 text/html to every method and path (an SSO login page, another
    web app on the port), recording nothing."""

    class Page(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _page(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = b"<html><body>Sign in</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = _page

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_push_refuses_answers_that_are_not_grafanas(
    web_page: str, grafana: tuple[str, StandIn]
) -> None:
    """A 2xx that is not Grafana's API is no success: a text/html page (it used to
    report every dashboard pushed), or a dashboard post answered without Grafana's
    status and uid."""
    with pytest.raises(PushError, match=r"not a Grafana API answer") as err:
        push(web_page, token=TOKEN)
    assert f"{web_page}/api/health" in str(err.value) and "Sign in" in str(err.value)
    url, state = grafana
    state.post_answer = {"message": "accepted"}
    with pytest.raises(PushError, match=r"/api/dashboards/db answered .*not a Grafana API"):
        push(url, token=TOKEN)
    state.post_answer = {"status": "success", "uid": "someone-else"}
    with pytest.raises(PushError, match=r"not a Grafana API answer"):
        push(url, token=TOKEN)
    state.post_answer = None
    assert push(url, token=TOKEN)["dashboards"] == [d.uid for d in D.DASHBOARDS]


def test_push_keeps_what_an_operator_set_on_the_data_source(
    grafana: tuple[str, StandIn],
) -> None:
    """An update merges spur's fields into the data source Grafana has: basic auth,
    TLS settings, headers, an operator's timeInterval stay (a PUT of spur's minimal
    body used to wipe them); secure values are never sent (Grafana keeps them)."""
    url, state = grafana
    state.datasources[D.DATASOURCE_UID] = {
        "id": 7,
        "uid": D.DATASOURCE_UID,
        "orgId": 1,
        "name": "spur-prometheus",
        "type": "prometheus",
        "access": "proxy",
        "url": "http://old-prom:9090",
        "basicAuth": True,
        "basicAuthUser": "scraper",
        "withCredentials": False,
        "isDefault": True,
        "version": 4,
        "readOnly": False,
        "jsonData": {
            "httpHeaderName1": "X-Scope-OrgID",
            "tlsSkipVerify": True,
            "timeInterval": "30s",
        },
        "secureJsonFields": {"basicAuthPassword": True, "httpHeaderValue1": True},
    }
    assert push(url, token=TOKEN, prometheus_url="http://prom:9090")["datasource"] == "updated"
    (sent,) = [b for m, p, b in state.calls if m == "PUT" and "/api/datasources/uid/" in p]
    assert sent["url"] == "http://prom:9090" and sent["type"] == "prometheus"
    assert sent["basicAuth"] is True and sent["basicAuthUser"] == "scraper"
    assert sent["isDefault"] is True and sent["version"] == 4
    assert sent["jsonData"] == {
        "httpHeaderName1": "X-Scope-OrgID",
        "tlsSkipVerify": True,
        "timeInterval": "30s",  # the operator's, over spur's 15s
        "httpMethod": "POST",
    }
    assert "secureJsonFields" not in sent and "secureJsonData" not in sent


def test_push_cli_reports_errors_without_traceback(grafana: tuple[str, StandIn]) -> None:
    url, _ = grafana
    cmd = [sys.executable, "-m", "spur.cluster.cli", "dashboards", "push", "--grafana-url", url]
    bad = subprocess.run([*cmd, "--token", "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.count("\n") == 1 and "401" in bad.stderr
    ok = subprocess.run([*cmd, "--token", TOKEN], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["dashboards"] == [d.uid for d in D.DASHBOARDS]


def test_export_writes_three_dashboards_and_the_chart_copies_are_fresh(tmp_path: Path) -> None:
    paths = D.export(tmp_path)
    names = sorted(p.name for p in paths)
    assert names == ["alerts.yaml", "spur-capacity.json", "spur-lanes.json", "spur-overview.json"]
    chart = ROOT / "helm" / "spur" / "files"
    for p in paths:
        shipped = (
            chart / "alerts.yaml" if p.name == "alerts.yaml" else chart / "dashboards" / p.name
        )
        assert shipped.read_text() == p.read_text(), (
            f"{shipped} is stale: run `python -m spur.cluster.dashboards`"
        )
    for p in paths[:-1]:
        model = json.loads(p.read_text())
        variables = {v["name"]: v for v in model["templating"]["list"]}
        assert model["panels"] and set(variables) == {"datasource", "lane", "model"}
        # Every query goes through the datasource variable, which defaults to the data
        # source `spur dashboards push` creates: a Grafana provisioned by the chart's sidecar has
        # its own Prometheus under another uid.
        assert variables["datasource"]["current"]["value"] == D.DATASOURCE_UID
        uids = {t["datasource"]["uid"] for panel in model["panels"] for t in panel["targets"]}
        uids |= {panel["datasource"]["uid"] for panel in model["panels"]}
        uids |= {variables[v]["datasource"]["uid"] for v in ("lane", "model")}
        assert uids == {"${datasource}"}


def test_promtool_accepts_the_rules() -> None:
    res = subprocess.run(
        [_promtool(), "check", "rules", str(ROOT / "helm" / "spur" / "files" / "alerts.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(D.ALERTS)} rules found" in res.stdout


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("no `promtool`: install Debian's prometheus package (.ci/run does)")
    return promtool


def _panel_expr(title: str) -> str:
    """A panel's first query, with the dashboard variables set to match everything."""
    panel = next(p for d in D.DASHBOARDS for p in d.panels if p.title == title)
    return (
        panel.targets[0][0]
        .replace("$lane", ".*")
        .replace("$model", ".*")
        .replace("$__rate_interval", "5m")
    )


def test_the_alerts_fire_and_resolve_on_synthetic_series(tmp_path: Path) -> None:
    """`promtool test rules` on the chart's rule file: each alert fires when its
    condition holds and clears when it stops (the 5xx alert: test_rules.py)."""
    rules = ROOT / "helm" / "spur" / "files" / "alerts.yaml"
    engine = 'lane="chat",engine="r1",model_name="smol",serves="chat"'
    hit_rate = _panel_expr("Prefix cache hit rate")
    tests = {
        "rule_files": [str(rules)],
        "evaluation_interval": "15s",
        "tests": [
            {  # one violation at 1 min: it pages, then clears (it used to fire for good)
                "name": "leak_fires_then_resolves",
                "interval": "1m",
                "input_series": [
                    {"series": f"spur:kv_leak_violations_total{{{engine}}}", "values": "0 1x180"}
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "2m",
                        "alertname": "SpurKVLeakViolations",
                        "exp_alerts": [_fired("SpurKVLeakViolations", lane="chat", engine="r1")],
                    },
                    {"eval_time": "150m", "alertname": "SpurKVLeakViolations", "exp_alerts": []},
                ],
            },
            {  # a node whose counter series is born at its first failure (1): failures
                # at 0, 4 and 8 min are 3 in 10 min; 2 min later, only 2 are
                "name": "slow_restart_loop_on_a_fresh_node",
                "interval": "15s",
                "input_series": [
                    {
                        "series": 'spur:replica_start_failures_total{lane="chat",node="n2"}',
                        "values": "1x15 2x15 3x15 3x40",
                    },
                    {"series": 'spur:restart_loop{lane="chat",node="n2"}', "values": "0x90"},
                ],
                "alert_rule_test": [
                    {"eval_time": "7m", "alertname": "SpurRestartLoop", "exp_alerts": []},
                    {
                        "eval_time": "9m",
                        "alertname": "SpurRestartLoop",
                        "exp_alerts": [_fired("SpurRestartLoop", lane="chat", node="n2")],
                    },
                    {"eval_time": "11m", "alertname": "SpurRestartLoop", "exp_alerts": []},
                ],
            },
            {  # the hit-rate panel at 0.5 queried tokens/s, every one a hit: 1, not 0.5;
                # no queries at all: no point rather than 0
                "name": "prefix_hit_rate_panel",
                "interval": "1m",
                "input_series": [
                    {
                        "series": f"vllm:prefix_cache_queries_total{{{engine}}}",
                        "values": "0+30x20 600x20",
                    },
                    {
                        "series": f"vllm:prefix_cache_hits_total{{{engine}}}",
                        "values": "0+30x20 600x20",
                    },
                ],
                "promql_expr_test": [
                    {
                        "expr": hit_rate,
                        "eval_time": "15m",
                        "exp_samples": [{"labels": '{lane="chat"}', "value": 1}],
                    },
                    {"expr": hit_rate, "eval_time": "35m", "exp_samples": []},
                ],
            },
        ],
    }
    path = tmp_path / "alerts_test.yaml"
    path.write_text(json.dumps(tests))  # JSON is YAML
    res = subprocess.run(
        [_promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_requests_works_next_to_grafana_client(grafana: tuple[str, StandIn]) -> None:
    """grafana-client 4.x / 5.x would have replaced urllib3 with urllib3-future here
    (niquests) and broken every requests-based tool (schemathesis among them)."""
    import grafana_client
    import requests
    import urllib3

    url, _ = grafana
    assert requests.get(f"{url}/api/health", timeout=10).json()["database"] == "ok"
    assert not hasattr(urllib3, "__future__version__") and "future" not in urllib3.__file__
    assert int(grafana_client.__version__.split(".")[0]) < 4
