"""Generate the chart's Grafana dashboard (deploy/helm/weightsync/dashboards/weightsync.json) with
grafana-foundation-sdk: the panels and their PromQL are declared here, never edited in the JSON.

The chart ships the file as a ConfigMap the Grafana sidecar loads (`metrics.dashboard.enabled`).
tests/deploy/test_observability.py regenerates it and fails on any difference, and checks every
metric its queries name against a real trainer's and rollout's /metrics, so run this after a change:

    python scripts/gen_dashboard.py            # write
    python scripts/gen_dashboard.py --check    # exit 1 if the committed file differs

`route` (e.g. ipc/trainer_writes/bf16) is a label of the trainer's weightsync_sync_duration_seconds
and weightsync_sync_phase_seconds only: the "by route" panels group those two by it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "deploy" / "helm" / "weightsync" / "dashboards" / "weightsync.json"
NS = 'namespace=~"$namespace"'
RATE = "$__rate_interval"
PHASES = "plan|prepare|stream|commit"


def sel(metric: str, **labels: str) -> str:
    """`metric{namespace=~"$namespace", k="v", ...}`; a value starting with '~' or '!' is a regex / negation."""
    parts = [NS]
    for k, v in labels.items():
        op = {"~": "=~", "!": "!="}.get(v[:1], "=")
        parts.append(f'{k}{op}"{v[1:] if op != "=" else v}"')
    return f"{metric}{{{', '.join(parts)}}}"


def quantile(q: float, histogram: str, by: str, **labels: str) -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({sel(histogram + '_bucket', **labels)}[{RATE}])))"


def weightsync_pods(expr: str) -> str:
    """`expr` kept to the pods that export weightsync metrics (the process_* families are everyone's)."""
    return f"{expr} and on (namespace, pod) {sel('weightsync_weights_version')}"


BEHIND = (
    f"(max by (namespace) ({sel('weightsync_weights_version', role='trainer')}) - on (namespace) group_right "
    f"min by (namespace, pod) ({sel('weightsync_weights_version', role='rollout')})) > 0"
)

# (row title, [(panel kind, title, unit, description, [(expr, legend)])])
ROWS = [
    (
        "Fleet",
        [
            (
                "timeseries",
                "Weights version per pod",
                "none",
                "The version each trainer holds and each rollout serves",
                [(f"max by (role, pod) ({sel('weightsync_weights_version')})", "{{role}} {{pod}}")],
            ),
            (
                "stat",
                "Rollouts STALE",
                "none",
                "Rollouts whose in-place sync failed: generation refused until a sync commits",
                [(f"sum({sel('weightsync_rollout_state', role='rollout', state='STALE')}) or vector(0)", "STALE")],
            ),
            (
                "stat",
                "Rollouts behind the trainer",
                "none",
                "Rollouts serving a lower version than their trainer holds",
                [(f"count({BEHIND}) or vector(0)", "behind")],
            ),
            (
                "stat",
                "Registered rollouts",
                "none",
                "Rollouts registered with the trainer",
                [(f"sum({sel('weightsync_registered_rollouts')})", "registered")],
            ),
            (
                "timeseries",
                "Rollouts by engine state",
                "none",
                "LOADING, SERVING, SYNCING, APPLYING, STALE",
                [(f"sum by (state) ({sel('weightsync_rollout_state', role='rollout')})", "{{state}}")],
            ),
        ],
    ),
    (
        "Syncs",
        [
            (
                "timeseries",
                "Sync duration p50 / p95",
                "s",
                "Trainer: Sync call to the last commit",
                [
                    (quantile(0.5, "weightsync_sync_duration_seconds", "role", role="trainer"), "p50"),
                    (quantile(0.95, "weightsync_sync_duration_seconds", "role", role="trainer"), "p95"),
                ],
            ),
            (
                "timeseries",
                "Sync phase p95",
                "s",
                "plan, prepare, stream, commit",
                [(quantile(0.95, "weightsync_sync_phase_seconds", "phase", phase="~" + PHASES), "{{phase}}")],
            ),
            (
                "timeseries",
                "Sync duration by route p50 / p95",
                "s",
                "route: transport/direction/format, e.g. ipc/trainer_writes/bf16",
                [
                    (quantile(0.5, "weightsync_sync_duration_seconds", "route", role="trainer"), "p50 {{route}}"),
                    (quantile(0.95, "weightsync_sync_duration_seconds", "route", role="trainer"), "p95 {{route}}"),
                ],
            ),
            (
                "timeseries",
                "Sync phase p95 by route",
                "s",
                "Which phase of which route takes the time",
                [
                    (
                        quantile(0.95, "weightsync_sync_phase_seconds", "route, phase", phase="~" + PHASES),
                        "{{route}} {{phase}}",
                    )
                ],
            ),
            (
                "timeseries",
                "Sync throughput against the link",
                "Bps",
                "Weight bytes each rollout took per second of its syncs, and the NCCL link's last measured rate",
                [
                    (
                        f"sum by (pod) (rate({sel('weightsync_sync_bytes_total', role='rollout')}[{RATE}])) / "
                        f"sum by (pod) (rate({sel('weightsync_sync_duration_seconds_sum', role='rollout')}[{RATE}]))",
                        "{{pod}}",
                    ),
                    (f"max({sel('weightsync_nccl_link_bytes_per_second', role='trainer')}) > 0", "NCCL link"),
                ],
            ),
            (
                "timeseries",
                "Bus bytes per second by encoding",
                "Bps",
                "What syncs put on the bus, full buckets or deltas",
                [
                    (
                        f"sum by (encoding) (rate({sel('weightsync_sync_wire_bytes_total', role='trainer')}[{RATE}]))",
                        "{{encoding}}",
                    )
                ],
            ),
            (
                "timeseries",
                "Delta wire ratio",
                "percentunit",
                "Bytes on the bus per weight byte committed (1: full buckets; below: deltas sent only changed words)",
                [
                    (
                        f"sum(rate({sel('weightsync_sync_wire_bytes_total', role='trainer')}[{RATE}])) / "
                        f"sum(rate({sel('weightsync_sync_bytes_total', role='trainer')}[{RATE}]))",
                        "wire / weights",
                    )
                ],
            ),
            (
                "timeseries",
                "Syncs by outcome",
                "none",
                "Trainer: ok, partial, failed; rollout: committed, failed, aborted",
                [
                    (
                        f"sum by (role, outcome) (increase({sel('weightsync_syncs_total')}[{RATE}]))",
                        "{{role}} {{outcome}}",
                    )
                ],
            ),
            (
                "timeseries",
                "Sync failures by reason",
                "none",
                "data_loss, silent, prepare_failed, commit_failed, transport, ...",
                [
                    (
                        f"sum by (role, reason) (increase({sel('weightsync_sync_failures_total')}[{RATE}]))",
                        "{{role}} {{reason}}",
                    )
                ],
            ),
            (
                "stat",
                "DATA_LOSS in range",
                "none",
                "Buckets a rollout's checksum found corrupted",
                [
                    (
                        f"sum(increase({sel('weightsync_sync_failures_total', reason='data_loss')}[$__range])) "
                        "or vector(0)",
                        "DATA_LOSS",
                    )
                ],
            ),
            (
                "stat",
                "Aborted syncs in range",
                "none",
                "Syncs rollouts aborted (trainer's AbortSync, timeout, superseded)",
                [
                    (
                        f"sum(increase({sel('weightsync_syncs_total', role='rollout', outcome='aborted')}[$__range])) "
                        "or vector(0)",
                        "aborted",
                    )
                ],
            ),
        ],
    ),
    (
        "Generation",
        [
            (
                "timeseries",
                "Generation latency p50 / p95 per rollout",
                "s",
                "Answered requests, admission and queueing included",
                [
                    (quantile(0.5, "weightsync_generation_duration_seconds", "pod"), "p50 {{pod}}"),
                    (quantile(0.95, "weightsync_generation_duration_seconds", "pod"), "p95 {{pod}}"),
                ],
            ),
            (
                "timeseries",
                "Tokens per second per rollout",
                "none",
                "Generated tokens (every sample)",
                [(f"sum by (pod) (rate({sel('weightsync_completion_tokens_total')}[{RATE}]))", "{{pod}}")],
            ),
            (
                "timeseries",
                "Requests in flight per rollout",
                "none",
                "Admitted and not yet answered",
                [(f"sum by (pod) ({sel('weightsync_generation_requests_in_flight')})", "{{pod}}")],
            ),
            (
                "timeseries",
                "Requests refused or failed",
                "reqps",
                "Refused before any work (budget, busy) and answered with an error or cancelled",
                [
                    (
                        f"sum by (reason) (rate({sel('weightsync_requests_refused_total')}[{RATE}]))",
                        "refused {{reason}}",
                    ),
                    (
                        f"sum by (outcome) (rate({sel('weightsync_generate_requests_total', outcome='!ok')}[{RATE}]))",
                        "{{outcome}}",
                    ),
                ],
            ),
        ],
    ),
    (
        "Processes",
        [
            (
                "timeseries",
                "Resident memory per pod",
                "bytes",
                "Host memory of each trainer and rollout process",
                [(weightsync_pods(sel("process_resident_memory_bytes")), "{{pod}}")],
            ),
            (
                "timeseries",
                "CPU per pod",
                "percentunit",
                "CPU seconds per second",
                [(weightsync_pods(f"rate({sel('process_cpu_seconds_total')}[{RATE}])"), "{{pod}}")],
            ),
            (
                "timeseries",
                "Auth failures",
                "reqps",
                "Control-plane calls refused for their token",
                [(f"sum by (role) (rate({sel('weightsync_auth_failures_total')}[{RATE}]))", "{{role}}")],
            ),
        ],
    ),
]


def build() -> dict:
    from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, GridPos, VariableRefresh

    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")
    d = (
        dashboard.Dashboard("weightsync")
        .uid("weightsync")
        .description("Weight syncs and generation of a weightsync fleet (generated by scripts/gen_dashboard.py)")
        .tags(["weightsync"])
        .refresh("30s")
        .time("now-1h", "now")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            dashboard.QueryVariable("namespace")
            .label("Namespace")
            .datasource(ds)
            .query("label_values(weightsync_weights_version, namespace)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True)
            .include_all(True)
        )
    )
    ids = iter(range(1, 1000))  # Grafana keys panel state (links, the edited panel) by id
    for title, panels in ROWS:
        d = d.with_row(dashboard.Row(title).id(next(ids)))
        for kind, name, unit, description, queries in panels:
            p = (stat if kind == "stat" else timeseries).Panel().id(next(ids)).title(name).unit(unit)
            p = p.description(description)
            p = p.datasource(ds).grid_pos(GridPos(h=4 if kind == "stat" else 8, w=6 if kind == "stat" else 12))
            for i, (expr, legend) in enumerate(queries):
                p = p.with_target(prometheus.Dataquery().expr(expr).legend_format(legend).ref_id("ABCDEFGH"[i]))
            d = d.with_panel(p)
    return json.loads(json.dumps(d.build(), cls=JSONEncoder))


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def queries(doc: dict) -> list[str]:
    """Every PromQL expression of a dashboard JSON (panels in rows included)."""
    out = []
    for panel in doc["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            out += [t["expr"] for t in p.get("targets", []) if t.get("expr")]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed dashboard differs")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python scripts/gen_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)} ({len(queries(build()))} queries)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
