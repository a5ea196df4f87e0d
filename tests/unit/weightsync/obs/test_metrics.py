"""Every metric family is defined once, in weightsync/obs/metrics.py, with `role` as a label."""
from prometheus_client import CollectorRegistry

from weightsync.obs.metrics import RolloutMetrics, SyncMetrics, TrainerMetrics, TrainMetrics


def _families(registry: CollectorRegistry) -> dict[str, set[str]]:
    """family name -> label names of its samples (the role label must be on every one)."""
    out: dict[str, set[str]] = {}
    for fam in registry.collect():
        for s in fam.samples:
            out.setdefault(fam.name, set()).update(s.labels)
    return out


def test_every_family_of_both_services_carries_its_role():
    trainer = SyncMetrics("trainer")
    TrainerMetrics(trainer.registry)
    TrainMetrics(trainer.registry).observe(3, {"loss": 0.5, "rollout_logprobs_given": 1})
    rollout = SyncMetrics("rollout")
    rm = RolloutMetrics(rollout.registry)
    rm.request("ok")
    rm.set_state("SERVING", True)
    rollout.outcome("committed")
    trainer.failure("transport")
    trainer.sync_phase.labels("trainer", "plan").observe(0.1)
    for role, m in (("trainer", trainer), ("rollout", rollout)):
        fams = _families(m.registry)
        assert fams, role
        for name, labels in fams.items():
            assert "role" in labels, (role, name, labels)
        for fam in m.registry.collect():
            assert {s.labels.get("role") for s in fam.samples} <= {role}, (role, fam.name)
    t, r = _families(trainer.registry), _families(rollout.registry)
    assert "weightsync_train_steps" in t and "weightsync_registered_rollouts" in t
    assert "weightsync_generate_requests" in r and "weightsync_rollout_state" in r
    assert "weightsync_train_steps" not in r and "weightsync_generate_requests" not in t


def test_nccl_group_builds_is_one_family_with_a_role_label():
    for role in ("trainer", "rollout"):
        m = SyncMetrics(role)
        assert m.registry.get_sample_value("weightsync_nccl_group_builds_total", {"role": role}) == 0
        m.nccl_group_builds.inc()
        m.nccl_group_builds.inc()
        assert m.registry.get_sample_value("weightsync_nccl_group_builds_total", {"role": role}) == 2
        assert m.registry.get_sample_value("weightsync_nccl_group_builds_total") is None  # no unlabelled series
