"""The Helm chart renders, lints, validates against Kubernetes schemas, and only names knobs the
services accept. Helm itself runs in-process via helm-python-sdk (Helm v4's Go library); the
Kubernetes JSON schemas come from kubernetes-validate. No network at test time."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python.chart", reason="pip install helm-python-sdk (see README test command)")
kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

from rollout_svc.config import RolloutConfig  # noqa: E402
from trainer_svc.config import TrainerConfig  # noqa: E402
from weightsync.config import flag_name, leaf_fields, leaf_names, parse_host_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "weightsync"
# the CI cases and the documented GPU-cluster example
VALUES = sorted((CHART / "ci").glob("*-values.yaml")) + [CHART / "values-gpu-example.yaml"]
K8S_VERSION = "1.34.0"
FIELDS = {"trainer": set(leaf_names(TrainerConfig)), "rollout": set(leaf_names(RolloutConfig))}
PREFIX = {"trainer": "WS_TRAINER_", "rollout": "WS_ROLLOUT_"}
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}


def render(values: dict) -> list[dict]:
    chart = helm.Chart.load(str(CHART))
    chart.validate_schema(values)
    out = chart.render(values, name="ws", namespace="rl", is_install=True)
    docs = []
    for path, text in out.items():
        if path.endswith(".txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def load(p: Path) -> dict:
    return yaml.safe_load(p.read_text()) or {}


@pytest.fixture(scope="module", params=VALUES, ids=[p.stem for p in VALUES])
def rendered(request):
    return request.param, render(load(request.param))


def test_example_values_exist():
    assert {p.stem for p in VALUES} >= {
        "default-values",
        "external-trainer-values",
        "colocated-values",
        "multi-node-values",
        "auth-values",
        "values-gpu-example",
    }


@pytest.mark.parametrize("values", VALUES, ids=[p.stem for p in VALUES])
def test_helm_lint_strict(values):
    report = helm.lint(str(CHART), load(values), strict=True, kube_version="v" + K8S_VERSION)
    bad = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not bad, bad


def test_objects_validate_against_kubernetes_schemas(rendered):
    _, docs = rendered
    kinds = set()
    for d in docs:
        kinds.add(d["kind"])
        if (d["apiVersion"], d["kind"]) in CRDS:
            if d["kind"] == "ServiceMonitor":
                assert d["spec"]["endpoints"] and d["spec"]["selector"]["matchLabels"]
            else:  # its rules: tests/deploy/test_observability.py
                assert all(r["alert"] and r["expr"] for g in d["spec"]["groups"] for r in g["rules"])
            continue
        kv.validate(d, K8S_VERSION, strict=True)
    assert {"ConfigMap", "Service"} <= kinds


def _containers(docs):
    for d in docs:
        spec = d.get("spec", {}).get("template", {}).get("spec")
        if spec:
            for c in spec["containers"]:
                yield d, spec, c


def _role(c) -> str:
    return "trainer" if c["name"] == "trainer" else "rollout"


def _config_files(docs) -> dict[str, dict]:
    """The services' config files; a release without a trainer (trainer.enabled=false) has no trainer.yaml."""
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    return {
        role: yaml.safe_load(cm["data"][f"{role}.yaml"])
        for role in ("trainer", "rollout")
        if f"{role}.yaml" in cm["data"]
    }


def test_config_keys_env_and_flags_are_known_to_the_services(rendered):
    _, docs = rendered
    files = _config_files(docs)
    for role, cfg in files.items():
        unknown = set(cfg) - FIELDS[role]
        assert not unknown, f"{role}.yaml keys not in {role} config: {unknown}"
    seen = 0
    for _, _, c in _containers(docs):
        role = _role(c)
        for e in c.get("env", []):
            for prefix in PREFIX.values():
                if e["name"].startswith(prefix):
                    assert prefix == PREFIX[role], f"{e['name']} set on the {role} container"
                    field = e["name"][len(prefix) :].lower()
                    assert field in FIELDS[role] or field == "config", e["name"]
        argv = c["command"]
        if argv[0] == "/bin/sh":
            argv = shlex.split(argv[2].replace("$((POD_INDEX + 1))", "1"))[1:]  # drop `exec`
        tail = argv[argv.index("serve") + 1 :]
        flags = [t for t in tail if t.startswith("--")]
        allowed = {"--config"} | {flag_name(f) for f in FIELDS[role]}
        assert set(flags) <= allowed, f"{role}: unknown flags {set(flags) - allowed}"
        if "--config" in tail:
            assert tail[tail.index("--config") + 1].endswith(f"/{role}.yaml")
        seen += 1
    assert seen >= 1


def test_probes_and_ports_match_the_config(rendered):
    _, docs = rendered
    files = _config_files(docs)
    for _, _, c in _containers(docs):
        role = _role(c)
        cfg = files[role]
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        if "startupProbe" not in c:  # trainer worker ranks serve neither gRPC nor HTTP
            assert "torchrun" in " ".join(c["command"])
            continue
        grpc_port = parse_host_port("grpc_address", cfg["grpc_address"])[1]
        http_port = parse_host_port("http_address", cfg["http_address"])[1]
        assert c["startupProbe"]["grpc"]["port"] == grpc_port
        assert c["startupProbe"]["grpc"]["service"] in ("", f"weightsync.v1.{role.capitalize()}")
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            get = c[probe]["httpGet"]
            assert get["path"] == path
            assert ports[get["port"]] == http_port, f"{role} {probe} -> {get['port']}"
        assert grpc_port in ports.values()
        if role == "rollout":
            assert parse_host_port("data_address", cfg["data_address"])[1] in ports.values()


def test_services_target_declared_ports(rendered):
    _, docs = rendered
    names = {p["name"] for _, _, c in _containers(docs) for p in c.get("ports", [])}
    for d in docs:
        if d["kind"] == "Service":
            for p in d["spec"]["ports"]:
                assert p["targetPort"] in names, (d["metadata"]["name"], p)


def test_pods_run_as_non_root(rendered):
    _, docs = rendered
    for _, spec, c in _containers(docs):
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_schema_enums_match_config_choices():
    schema = json.loads((CHART / "values.schema.json").read_text())
    for role, cls in (("trainer", TrainerConfig), ("rollout", RolloutConfig)):
        props = schema["properties"][role]["properties"]["config"]["properties"]
        for f in leaf_fields(cls):
            if f.name in props and f.metadata.get("choices"):
                assert props[f.name]["enum"] == list(f.metadata["choices"]), f.name
        assert set(props) <= FIELDS[role]


def test_mode_specific_wiring():
    colo = render(load(CHART / "ci" / "colocated-values.yaml"))
    assert _config_files(colo)["trainer"]["transport"] == "ipc"
    pod = next(d for d in colo if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    assert [c["resources"]["claims"] for c in pod["containers"]] == [[{"name": "gpus"}]] * 2
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod["volumes"])
    auth = render(load(CHART / "ci" / "auth-values.yaml"))
    token_file = _config_files(auth)["rollout"]["auth_token_file"]
    assert any(d["kind"] == "Secret" for d in auth) and token_file.startswith("/var/run/secrets/")
    multi = render(load(CHART / "ci" / "multi-node-values.yaml"))
    sts = {d["metadata"]["name"]: d for d in multi if d["kind"] == "StatefulSet"}
    assert sts["ws-weightsync-trainer-worker"]["spec"]["replicas"] == 1
    assert any(d["kind"] == "ServiceMonitor" for d in multi)


@pytest.mark.parametrize(
    "override, match",
    [
        ({"mode": "hybrid"}, "mode"),
        ({"trainer": {"config": {"transport": "carrier-pigeon"}}}, "transport"),
        ({"trainer": {"config": {"grpc_address": "0.0.0.0:1"}}}, "grpc_address"),
        ({"rollout": {"ports": {"grpc": 70000}}}, "grpc"),
        ({"surprise": True}, "surprise"),
    ],
)
def test_schema_rejects_bad_values(override, match):
    with pytest.raises(Exception, match=match):
        render(override)


def test_broken_values_file_is_rejected():
    with pytest.raises(Exception, match="transport") as ei:  # helm's own error type; the message names each field
        render(load(Path(__file__).with_name("broken-values.yaml")))
    assert "grpc_address" in str(ei.value)


@pytest.mark.parametrize(
    "override, match",
    [
        ({"trainer": {"nnodes": 2, "nprocPerNode": 4}}, "must equal the torchrun world size"),
        ({"rollout": {"config": {"dtype": "float16"}}}, "export_dtype"),
        ({"rollout": {"multiNode": {"enabled": True}}}, "not implemented yet"),
        ({"mode": "colocated", "trainer": {"nnodes": 2, "config": {"tp": 2}}}, "nnodes must be 1"),
        # rollouts for an external publisher: where it is, who it is, and nothing of a trainer
        ({"trainer": {"enabled": False}}, 'rollout.trainerAddress="": with trainer.enabled=false set it'),
        (
            {"trainer": {"enabled": False}, "rollout": {"trainerAddress": "pub.ml.svc:50051"}},
            "networkPolicy.trainerFrom is empty",
        ),
        ({"rollout": {"trainerAddress": "pub.ml.svc:50051"}}, "set trainer.enabled=false too"),
        (
            {"mode": "colocated", "trainer": {"enabled": False}, "rollout": {"trainerAddress": "pub.ml.svc:50051"}},
            "set mode=disaggregated",
        ),
        (
            {
                "trainer": {"enabled": False},
                "rollout": {"trainerAddress": "pub.ml.svc:50051"},
                "networkPolicy": {"enabled": False},
                "persistence": {"enabled": True},
            },
            "set persistence.enabled=false",
        ),
    ],
)
def test_render_time_checks_fail_with_a_reason(override, match):
    with pytest.raises(Exception, match=match):
        render(override)


def test_default_values_render_a_secret_backed_token():
    """Secure by default: no values at all give both services a generated token from a Secret."""
    import base64

    docs = render({})
    secrets = [d for d in docs if d["kind"] == "Secret"]
    assert len(secrets) == 1, "the default install must create the token Secret"
    token = base64.b64decode(secrets[0]["data"]["token"]).decode()
    assert len(token) == 48 and token.isalnum()
    files = _config_files(docs)
    for role in ("trainer", "rollout"):
        assert files[role]["auth_token_file"] == "/var/run/secrets/weightsync/token", role
        assert "insecure" not in files[role]
    mounted = 0
    for _, pod, c in _containers(docs):
        vols = {v["name"]: v for v in pod.get("volumes", [])}
        for m in c.get("volumeMounts", []):
            if m["mountPath"] == "/var/run/secrets/weightsync":
                assert vols[m["name"]]["secret"]["secretName"] == secrets[0]["metadata"]["name"]
                mounted += 1
    assert mounted >= 2  # the trainer and the rollout
    # turning auth off is an explicit, visible choice: the services are told they run insecure
    off = render({"auth": {"enabled": False}})
    assert not any(d["kind"] == "Secret" for d in off)
    assert all(f.get("insecure") is True and "auth_token_file" not in f for f in _config_files(off).values())


def test_a_generation_key_secret_reaches_the_rollouts_only():
    docs = render({"auth": {"generationKeySecret": "gen-key", "generationKeySecretKey": "key"}})
    seen = {}
    for _, _, c in _containers(docs):
        for e in c.get("env", []):
            if e["name"] == "WS_ROLLOUT_GENERATION_TOKEN":
                seen[c["name"]] = e["valueFrom"]["secretKeyRef"]
    assert seen and all(ref == {"name": "gen-key", "key": "key"} for ref in seen.values()), seen
    assert all("rollout" in name for name in seen), seen
    assert not any(
        e["name"] == "WS_ROLLOUT_GENERATION_TOKEN" for _, _, c in _containers(render({})) for e in c.get("env", [])
    )


def test_the_sync_link_can_be_turned_off_and_bounded_from_values():
    docs = render(
        {"trainer": {"config": {"sync_link": False}}, "rollout": {"config": {"sync_link": False, "max_sync_links": 2}}}
    )
    files = _config_files(docs)
    assert files["trainer"]["sync_link"] is False
    assert files["rollout"]["sync_link"] is False and files["rollout"]["max_sync_links"] == 2
    with pytest.raises(Exception, match="max_sync_links"):
        render({"rollout": {"config": {"max_sync_links": 0}}})


def test_rollouts_for_an_external_publisher_render_without_a_trainer():
    values = load(CHART / "ci" / "external-trainer-values.yaml")
    docs = render(values)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    # no trainer of this release: no StatefulSet, Service, NetworkPolicy or PDB of one, no trainer.yaml
    assert not any("trainer" in name for _, name in names), sorted(names)
    assert not any(d["kind"] == "StatefulSet" for d in docs)
    files = _config_files(docs)
    assert set(files) == {"rollout"}
    assert files["rollout"]["trainer_address"] == values["rollout"]["trainerAddress"]
    assert files["rollout"]["auth_token_file"] == "/var/run/secrets/weightsync/token"  # the publisher's token
    # the rollouts admit the external publisher's ranks (listed peers) on gRPC, data and NCCL ports
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy")
    first = policy["spec"]["ingress"][0]
    assert first["from"] == values["networkPolicy"]["trainerFrom"]
    ports = {p["port"] for p in first["ports"]}
    assert {50061, 50071, 32768} <= ports, ports
    # without it the rollouts follow this release's trainer, admitted by its gang label
    default = next(d for d in render({}) if d["kind"] == "NetworkPolicy" and "rollout" in d["metadata"]["name"])
    assert default["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["weightsync.io/gang"] == "trainer"
