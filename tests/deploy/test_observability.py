"""The operator's view the chart ships: the Grafana dashboard is what scripts/gen_dashboard.py generates,
its ConfigMap and the PrometheusRule render from values (and only when asked), every runbook link lands
on a heading of docs/operations.md, and every metric any dashboard query or alert expression reads is
exported by a real trainer and rollout after a real sync (the PromQL parsed with promql-parser)."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

helm = pytest.importorskip("helm_python.chart", reason="pip install helm-python-sdk (see README test command)")
promql = pytest.importorskip("promql_parser", reason="pip install the test extra (promql-parser)")
pytest.importorskip("grafana_foundation_sdk", reason="pip install the test extra (grafana-foundation-sdk)")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tests.support.chart import load_script, render  # noqa: E402
from tests.support.local_apps import local_fleet  # noqa: E402
from weightsync.control.client import channel, trainer_stub  # noqa: E402
from weightsync.v1 import trainer_pb2  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "weightsync"
OPERATIONS = ROOT / "docs" / "operations.md"
TOKEN = "observability-test-token"
ON = {"metrics": {"dashboard": {"enabled": True}, "prometheusRule": {"enabled": True}}}
# series Prometheus makes itself, not a service
PROMETHEUS_OWN = {"up"}
# Grafana's variables, as Grafana substitutes them before the query reaches Prometheus
GRAFANA_VARS = {"$__rate_interval": "1m", "$__range": "1h", "$namespace": "rl"}


GEN = load_script("gen_dashboard")


def _one(docs: list[dict], kind: str, component: str) -> dict:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["labels"].get(_COMPONENT) == component]
    assert len(hits) == 1, [(d["kind"], d["metadata"]["name"]) for d in docs]
    return hits[0]


_COMPONENT = "app.kubernetes.io/component"


def alerts(values: dict = ON) -> list[dict]:
    return [r for g in _one(render(values), "PrometheusRule", "alerts")["spec"]["groups"] for r in g["rules"]]


def names_in(expr: str) -> set[str]:
    """The metric names an expression selects, from promql-parser's syntax tree."""
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    out: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, promql.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr}"
            out.add(node.name)
            return
        for attr in ("expr", "lhs", "rhs", "param", "vector_selector"):
            child = getattr(node, attr, None)
            if child is not None and not isinstance(child, (str, int, float)):
                walk(child)
        for arg in getattr(node, "args", None) or ():
            walk(arg)

    walk(promql.parse(expr))
    return out


def test_the_committed_dashboard_is_the_generated_one():
    assert GEN.OUT.read_text() == GEN.render(), "run python scripts/gen_dashboard.py"
    assert GEN.main(["--check"]) == 0


def test_dashboard_panels_cover_the_issue_list():
    doc = json.loads(GEN.OUT.read_text())
    exprs = GEN.queries(doc)
    assert len(exprs) == len(set(exprs)) >= 25
    titles = {p["title"] for p in doc["panels"]}
    assert {"Rollouts STALE", "Sync duration by route p50 / p95", "Delta wire ratio", "DATA_LOSS in range"} <= titles
    by_route = [e for e in exprs if "route" in e]
    # route is a label of exactly the trainer's sync duration and phase histograms
    assert by_route and all(
        names_in(e) <= {"weightsync_sync_duration_seconds_bucket", "weightsync_sync_phase_seconds_bucket"}
        for e in by_route
    ), by_route
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))


def test_nothing_renders_unless_asked_and_the_configmap_carries_the_generated_json():
    kinds = {(d["kind"], d["metadata"]["name"]) for d in render({})}
    assert not any(k == "PrometheusRule" or n.endswith("-dashboard") for k, n in kinds)
    docs = render({"metrics": {"dashboard": {"enabled": True, "labels": {"team": "rl"}}}})
    cm = _one(docs, "ConfigMap", "dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and cm["metadata"]["labels"]["team"] == "rl"
    assert json.loads(cm["data"]["weightsync.json"]) == json.loads(GEN.OUT.read_text())
    assert not [d for d in docs if d["kind"] == "PrometheusRule"]


def test_alert_thresholds_and_durations_come_from_values():
    rules = {
        r["alert"]: r
        for r in alerts(
            {
                "metrics": {
                    "prometheusRule": {
                        "enabled": True,
                        "syncP95SloSeconds": 7.5,
                        "slowFor": "45m",
                        "behindVersions": 3,
                        "window": "7m",
                        "runbookBaseUrl": "https://x.example/ops.md",
                    }
                }
            }
        )
    }
    assert rules["WeightsyncSyncSlow"]["expr"].endswith("[7m]))) > 7.5") and rules["WeightsyncSyncSlow"]["for"] == "45m"
    assert rules["WeightsyncRolloutBehind"]["expr"].endswith(" > 3")
    assert rules["WeightsyncDataLoss"]["annotations"]["runbook_url"] == "https://x.example/ops.md#weightsyncdataloss"
    assert 'job="ws-weightsync-trainer"' in rules["WeightsyncTrainerDown"]["expr"]
    with pytest.raises(Exception, match="syncP95SloSeconds"):
        render({"metrics": {"prometheusRule": {"enabled": True, "syncP95SloSeconds": 0}}})
    # rollouts for an external publisher: no trainer to alert on
    external = {a["alert"] for a in alerts({**_EXTERNAL, **ON})}
    assert "WeightsyncTrainerDown" not in external and "WeightsyncRolloutStale" in external


_EXTERNAL = yaml.safe_load((CHART / "ci" / "external-trainer-values.yaml").read_text())


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as dashes."""
    heads = re.findall(r"^#+\s+(.+?)\s*$", markdown, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_every_alert_has_a_runbook_section_that_exists():
    anchors = _anchors(OPERATIONS.read_text())
    rules = alerts()
    assert len(rules) == 8
    for r in rules:
        url = r["annotations"]["runbook_url"]
        assert url.startswith("docs/operations.md#"), url
        assert url.split("#", 1)[1] in anchors, (r["alert"], url)
        assert r["labels"]["severity"] in ("warning", "critical")


def _exported(port: int) -> set[str]:
    """Every series name /metrics can carry: each sample's, and for a family with no sample yet (a
    labelled counter nothing has counted) the names its type gives it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        fams = list(text_string_to_metric_families(r.read().decode()))
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    out = {s.name for f in fams for s in f.samples}
    out |= {f.name + sfx for f in fams for sfx in suffixes.get(f.type, ("",))}
    return out


def test_every_metric_the_dashboard_and_alerts_read_is_exported_after_a_real_sync():
    exprs = GEN.queries(json.loads(GEN.OUT.read_text())) + [r["expr"] for r in alerts()]
    wanted = set().union(*(names_in(e) for e in exprs))
    with local_fleet({"r1": {}}, TOKEN) as (trainer, rollouts, stub):
        report = stub.Sync(trainer_pb2.SyncRequest()).report
        assert report.ok, report
        with channel(trainer.grpc.address) as ch:  # a wrong token, refused and counted
            with pytest.raises(grpc.RpcError) as ei:
                trainer_stub(ch, "not-the-token", 30).GetStatus(trainer_pb2.TrainerStatusRequest())
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        exported = _exported(trainer.http.port) | _exported(rollouts["r1"].http.port)
        assert (
            trainer.host.metrics.registry.get_sample_value(
                "weightsync_auth_failures_total", {"role": "trainer", "surface": "grpc"}
            )
            == 1
        )
    missing = sorted(wanted - exported - PROMETHEUS_OWN)
    assert not missing, missing
    # the test reads real names: a typo'd metric would be caught
    assert "weightsync_sync_duration_seconds_bucket" in wanted and "weightsync_rollout_state" in wanted
    assert not names_in('rate(weightsync_sync_duraton_seconds_bucket{role="trainer"}[5m])') <= exported
