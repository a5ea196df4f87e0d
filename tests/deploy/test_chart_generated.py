"""The chart's values schema is generated from the config classes, every config field can be set
through values (and the services load what the chart renders), and the chart's volume, network,
spread and restart wiring. Helm runs in-process (helm-python-sdk), as in test_chart.py."""

from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python.chart", reason="pip install helm-python-sdk (see README test command)")

from rollout_svc.config import ENV_PREFIX as ROLLOUT_ENV  # noqa: E402
from rollout_svc.config import RolloutConfig  # noqa: E402
from tests.support.chart import load_script, render  # noqa: E402
from trainer_svc.config import ENV_PREFIX as TRAINER_ENV  # noqa: E402
from trainer_svc.config import TrainerConfig  # noqa: E402
from weightsync.config import (  # noqa: E402
    ConfigError,
    field_type,
    leaf_defaults,
    leaf_fields,
    resolve,
)

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "weightsync"
SCRIPT = ROOT / "scripts" / "gen_helm_schema.py"
K8S_VERSION = "1.34.0"
CLASSES = {"trainer": TrainerConfig, "rollout": RolloutConfig}
ENV = {"trainer": TRAINER_ENV, "rollout": ROLLOUT_ENV}


GEN = load_script("gen_helm_schema")


def lint(values: dict) -> list:
    report = helm.lint(str(CHART), values, strict=True, kube_version="v" + K8S_VERSION)
    return [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]


def schema_config(role: str) -> dict:
    schema = json.loads((CHART / "values.schema.json").read_text())
    return schema["properties"][role]["properties"]["config"]["properties"]


def config_files(docs) -> dict[str, dict]:
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    return {r: yaml.safe_load(cm["data"][f"{r}.yaml"]) for r in ("trainer", "rollout")}


def pod_specs(docs):
    """(object, pod spec) of every workload."""
    return [(d, d["spec"]["template"]["spec"]) for d in docs if d["kind"] in ("StatefulSet", "Deployment")]


def every_field_values() -> dict:
    """Values that set every config field the schema lets values set, each to its service default."""
    return {
        role: {"config": {name: leaf_defaults(cls)[name] for name in schema_config(role)}}
        for role, cls in CLASSES.items()
    }


# ---- the schema is generated, complete and faithful --------------------------------------------
def test_values_schema_is_what_the_generator_makes_from_the_config_classes(tmp_path):
    out = tmp_path / "values.schema.json"
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], check=True, timeout=120, capture_output=True)
    committed = (CHART / "values.schema.json").read_text()
    assert out.read_text() == committed, (
        "values.schema.json drifted from the config classes; run `python scripts/gen_helm_schema.py` and commit"
    )


@pytest.mark.parametrize("role", ["trainer", "rollout"])
def test_every_config_field_is_in_the_schema_unless_the_chart_sets_it_or_it_is_secret(role):
    props = schema_config(role)
    defaults = leaf_defaults(CLASSES[role])
    for f in leaf_fields(CLASSES[role]):
        secret, managed = bool(f.metadata.get("secret")), f.name in GEN.MANAGED[role]
        assert (f.name in props) != (secret or managed), f.name
        if f.name not in props:
            continue
        p = props[f.name]
        tp, is_list = field_type(f)
        assert p["type"] == ("array" if is_list else GEN._JSON_TYPES[tp]), f.name
        assert p["default"] == defaults[f.name] and p["description"] == f.metadata["help"], f.name
        if f.metadata.get("choices"):
            assert p["enum"] == list(f.metadata["choices"]), f.name
    # the fields docs/operations.md names as accepted, which the hand-written schema used to refuse
    if role == "trainer":
        assert {"checkpoint_dir", "resume", "lr", "ep", "mtp", "converter", "param_dtype", "grad_clip"} <= set(props)
    assert "auth_token" not in props and "auth_token_file" not in props


@pytest.mark.parametrize("role", ["trainer", "rollout"])
def test_secret_and_chart_managed_fields_cannot_be_set_through_values(role):
    for name in ("auth_token", "auth_token_file", "insecure", "grpc_address"):
        with pytest.raises(Exception, match=name):
            render({role: {"config": {name: "x"}}})


def _past(bound: str, limit, tp):
    step = 1 if tp is int else 0.5
    return {"minimum": limit - step, "maximum": limit + step, "exclusiveMinimum": limit}[bound]


@pytest.mark.parametrize("role", ["trainer", "rollout"])
def test_every_numeric_schema_bound_is_one_the_service_enforces(role):
    """A bound the schema adds to a field is the one its validate() checks: a value just past it is
    refused by the service too (naming the field), the limit itself is accepted by both."""
    cls, props = CLASSES[role], schema_config(role)
    types = {f.name: field_type(f)[0] for f in leaf_fields(cls)}
    checked = 0
    for name, bounds in GEN.BOUNDS[role].items():
        for bound, limit in bounds.items():
            if bound not in ("minimum", "maximum", "exclusiveMinimum"):
                continue
            assert props[name][bound] == limit
            with pytest.raises(ConfigError, match=name):
                cls.from_flat(**{name: _past(bound, limit, types[name])}).validate()
            ok = limit if bound != "exclusiveMinimum" else limit + (1 if types[name] is int else 0.5)
            if name == "max_inflight_requests":  # must stay >= max_inflight_per_client
                cls.from_flat(**{name: ok, "max_inflight_per_client": 1}).validate()
            else:
                cls.from_flat(**{name: ok}).validate()
            checked += 1
    assert checked >= 8


def test_lint_strict_and_the_services_load_the_chart_with_every_config_field_set(tmp_path):
    values = every_field_values()
    assert len(values["trainer"]["config"]) >= 30 and len(values["rollout"]["config"]) >= 20
    assert not lint(values)
    files = config_files(render(values))
    for role, cls in CLASSES.items():
        cfg = files[role]
        assert set(values[role]["config"]) <= set(cfg), set(values[role]["config"]) - set(cfg)
        # the rendered file, read by the service's own loader (file layer only: no flags, no env)
        path = tmp_path / f"{role}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        loaded = resolve(cls, argparse.Namespace(config_file=str(path)), ENV[role], environ={})
        flat = {
            f.name: getattr(getattr(loaded, sec), f.name)
            for sec in vars(loaded)
            for f in leaf_fields(type(getattr(loaded, sec)))
        }
        for name, value in values[role]["config"].items():
            assert flat[name] == value, (role, name)


def test_a_non_default_value_for_every_enum_renders():
    """Each choice the config accepts is accepted by the schema (one render per choice, where the
    chart's own cross-checks allow that choice on its own)."""
    for role in CLASSES:
        for name, p in schema_config(role).items():
            for choice in p.get("enum", []):
                if (role, name, choice) in {
                    ("trainer", "transport", "ipc"),
                    ("trainer", "backend", "hf"),
                    ("trainer", "converter", "mbridge"),
                    ("trainer", "converter", "megatron-bridge"),
                }:
                    continue  # refused at render time with a reason, or needs an optional package to validate
                values = {role: {"config": {name: choice}}}
                if name in ("export_dtype", "dtype"):
                    values = {"trainer": {"config": {"export_dtype": choice}}, "rollout": {"config": {"dtype": choice}}}
                    if choice == "fp8-block":
                        values = {"trainer": {"config": {"export_dtype": choice}}}
                render(values)


# ---- persistence ---------------------------------------------------------------------------
def _mounts(container) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}


def test_persistence_creates_a_kept_claim_mounted_at_the_trainers_data_root_and_checkpoint_dir():
    docs = render({"persistence": {"enabled": True, "storageClass": "fast", "size": "500Gi"}})
    pvc = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert len(pvc) == 1
    pvc = pvc[0]
    assert pvc["spec"]["storageClassName"] == "fast" and pvc["spec"]["resources"]["requests"]["storage"] == "500Gi"
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # uninstall keeps checkpoints
    assert config_files(docs)["trainer"]["data_root"] == "/data"
    assert config_files(docs)["trainer"]["checkpoint_dir"] == "/data/checkpoints"
    seen = set()
    for d, spec in pod_specs(docs):
        vols = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            if c["name"] == "trainer":
                assert _mounts(c)["data"] == "/data"
                assert vols["data"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
                seen.add(d["metadata"]["name"])
            else:
                assert "data" not in _mounts(c)
    assert seen == {"ws-weightsync-trainer"}
    assert not any(d["kind"] == "PersistentVolumeClaim" for d in render({}))  # off by default


def test_persistence_with_an_existing_claim_and_the_users_own_paths_on_it():
    docs = render(
        {
            "persistence": {"enabled": True, "existingClaim": "ckpts", "mountPath": "/ckpt"},
            "trainer": {"config": {"checkpoint_dir": "/ckpt/run7", "data_root": "/ckpt"}},
        }
    )
    assert not any(d["kind"] == "PersistentVolumeClaim" for d in docs)
    _, spec = next((d, s) for d, s in pod_specs(docs) if d["metadata"]["name"] == "ws-weightsync-trainer")
    assert {v["name"]: v for v in spec["volumes"]}["data"]["persistentVolumeClaim"]["claimName"] == "ckpts"
    assert _mounts(spec["containers"][0])["data"] == "/ckpt"
    assert config_files(docs)["trainer"]["checkpoint_dir"] == "/ckpt/run7"
    docs = render({"persistence": {"enabled": True, "storageClass": "-"}})
    assert next(d for d in docs if d["kind"] == "PersistentVolumeClaim")["spec"]["storageClassName"] == ""


def test_persistence_in_colocated_mode_and_for_a_trainer_gang():
    docs = render({"mode": "colocated", "persistence": {"enabled": True}})
    _, spec = pod_specs(docs)[0]
    by_name = {c["name"]: c for c in spec["containers"]}
    assert _mounts(by_name["trainer"])["data"] == "/data" and "data" not in _mounts(by_name["rollout"])
    gang = {
        "trainer": {"nnodes": 2, "config": {"tp": 2}},
        "persistence": {"enabled": True, "accessModes": ["ReadWriteMany"]},
    }
    docs = render(gang)
    mounted = {d["metadata"]["name"] for d, s in pod_specs(docs) if "data" in _mounts(s["containers"][0])}
    assert mounted == {"ws-weightsync-trainer", "ws-weightsync-trainer-worker"}  # every rank writes its shards


@pytest.mark.parametrize(
    "values, match",
    [
        (
            {"persistence": {"enabled": True}, "trainer": {"config": {"checkpoint_dir": "/home/ws/ckpt"}}},
            "checkpoint_dir=/home/ws/ckpt is outside persistence.mountPath",
        ),
        (
            {"persistence": {"enabled": True}, "trainer": {"config": {"data_root": "/database"}}},
            "data_root=/database is outside",
        ),
        ({"persistence": {"enabled": True}, "trainer": {"nnodes": 2, "config": {"tp": 2}}}, "ReadWriteMany"),
        ({"persistence": {"enabled": True, "size": "lots"}}, "size"),
    ],
)
def test_persistence_mistakes_fail_the_render_with_a_reason(values, match):
    with pytest.raises(Exception, match=match):
        render(values)


# ---- network policy, topology spread --------------------------------------------------------
@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_clients_from_reach_the_rollouts_grpc_and_http_ports(mode):
    peer = {"podSelector": {"matchLabels": {"app": "rl-driver"}}}
    docs = render({"mode": mode, "networkPolicy": {"clientsFrom": [peer]}})
    rules = [
        r
        for d in docs
        if d["kind"] == "NetworkPolicy"
        for r in d["spec"].get("ingress") or []
        if r.get("from") == [peer]
    ]
    assert len(rules) == 1
    assert {p["port"] for p in rules[0]["ports"]} == {50061, 8091}  # gRPC Generate and /v1/completions


def _rollout_spec(docs):
    return next(s for d, s in pod_specs(docs) if d["kind"] == "Deployment")


def test_rollout_pods_spread_over_nodes_by_default_and_as_configured():
    sel = {
        "app.kubernetes.io/name": "weightsync",
        "app.kubernetes.io/instance": "ws",
        "app.kubernetes.io/component": "rollout",
    }
    default = _rollout_spec(render({}))["topologySpreadConstraints"]
    assert default == [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "matchLabelKeys": ["pod-template-hash"],
            "labelSelector": {"matchLabels": sel},
        }
    ]
    own = {"matchLabels": {"tier": "gen"}}
    zones = [
        {"maxSkew": 2, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule"},
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": own,
        },
    ]
    got = _rollout_spec(render({"rollout": {"topologySpreadConstraints": zones}}))["topologySpreadConstraints"]
    assert got[0] == {**zones[0], "labelSelector": {"matchLabels": sel}} and got[1]["labelSelector"] == own
    assert "topologySpreadConstraints" not in _rollout_spec(render({"rollout": {"topologySpreadConstraints": []}}))
    with pytest.raises(Exception, match="whenUnsatisfiable"):
        render({"rollout": {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "x"}]}})


# ---- the token Secret restarts the pods ------------------------------------------------------
def _checksums(docs) -> dict[str, str | None]:
    return {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["annotations"].get("checksum/token")
        for d, _ in pod_specs(docs)
    }


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_pods_carry_the_checksum_of_the_chart_created_token(mode):
    base = {"mode": mode, "trainer": {"nnodes": 1}}
    docs = render(copy.deepcopy(base))
    secret = next(d for d in docs if d["kind"] == "Secret")
    token = base64.b64decode(secret["data"]["token"])
    sums = _checksums(docs)
    assert sums and set(sums.values()) == {hashlib.sha256(token).hexdigest()}
    a = _checksums(render({**base, "auth": {"token": "a" * 24}}))
    b = _checksums(render({**base, "auth": {"token": "b" * 24}}))
    assert set(a.values()) == {hashlib.sha256(b"a" * 24).hexdigest()} and a != b  # a new token restarts them


def test_no_token_checksum_for_an_existing_secret_or_without_auth():
    for values in ({"auth": {"existingSecret": "mine"}}, {"auth": {"enabled": False}}):
        docs = render(values)
        assert set(_checksums(docs).values()) == {None}, values
        assert all("checksum/config" in d["spec"]["template"]["metadata"]["annotations"] for d, _ in pod_specs(docs))


def test_sglang_options_set_in_values_reach_the_rollouts_config(tmp_path):
    """`rollout.config.sglang` is SGLang's own options, passed through to its Engine (checked there
    against the installed SGLang's ServerArgs; the schema only asks for a mapping)."""
    values = {
        "rollout": {"config": {"engine": "sglang", "sglang": {"mem_fraction_static": 0.6, "context_length": 8192}}}
    }
    assert not lint(values)
    cfg = config_files(render(values))["rollout"]
    path = tmp_path / "rollout.yaml"
    path.write_text(yaml.safe_dump(cfg))
    loaded = resolve(CLASSES["rollout"], argparse.Namespace(config_file=str(path)), ENV["rollout"], environ={})
    assert loaded.inference.sglang == {"mem_fraction_static": 0.6, "context_length": 8192}
    assert lint({"rollout": {"config": {"sglang": "mem_fraction_static=0.6"}}})  # not a mapping: refused
