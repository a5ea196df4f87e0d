"""Every weightsync metric family is defined once, in weightsync/obs/metrics.py, with `role` as a label."""

from prometheus_client import CollectorRegistry

from weightsync.obs.metrics import (
    RolloutMetrics,
    SyncMetrics,
    TrainerMetrics,
    TrainMetrics,
)

# the standard collectors of a service registry (process, platform, GC): no role label of ours
_STANDARD = {
    "process_virtual_memory_bytes",
    "process_resident_memory_bytes",
    "process_start_time_seconds",
    "process_cpu_seconds",
    "process_open_fds",
    "process_max_fds",
    "python_info",
    "python_gc_objects_collected",
    "python_gc_objects_uncollectable",
    "python_gc_collections",
}


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
    trainer.sync_phase.labels("trainer", "plan", "tcp/single/fp32/full").observe(0.1)
    for role, m in (("trainer", trainer), ("rollout", rollout)):
        fams = _families(m.registry)
        assert fams, role
        ours = {name: labels for name, labels in fams.items() if name.startswith("weightsync_")}
        assert ours and set(fams) - set(ours) <= _STANDARD, (role, set(fams) - set(ours))
        for name, labels in ours.items():
            assert "role" in labels, (role, name, labels)
        for fam in m.registry.collect():
            if fam.name.startswith("weightsync_"):
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


def test_service_registry_drops_created_twins_without_touching_other_registries():
    from prometheus_client import Counter, generate_latest

    m = SyncMetrics("rollout")
    m.outcome("committed")
    m.sync_duration.labels(m.role, "").observe(0.2)
    text = generate_latest(m.registry).decode()
    assert "weightsync_syncs_total{" in text and "weightsync_sync_duration_seconds_count{" in text
    assert "_created" not in text
    assert "process_cpu_seconds_total" in text and "python_info{" in text
    # prometheus_client's global default is left alone: a library user's own registry keeps its twins
    own = CollectorRegistry()
    Counter("app_events_total", "x", registry=own).inc()
    assert "app_events_created" in generate_latest(own).decode()


TRAINER_ONLY = {
    "weightsync_sync_phase_seconds",
    "weightsync_sync_sender_bytes",
    "weightsync_sync_sender_seconds",
    "weightsync_sync_forwarded_bytes",
    "weightsync_sync_sender_buffer_bytes",
    "weightsync_sync_calls",
    "weightsync_nccl_link_bytes_per_second",
}


def test_sync_families_only_the_trainer_reports_are_not_on_a_rollout():
    rollout, trainer = SyncMetrics("rollout"), SyncMetrics("trainer")
    r = {f.name for f in rollout.registry.collect()}
    t = {f.name for f in trainer.registry.collect()}
    assert TRAINER_ONLY <= t and not TRAINER_ONLY & r, TRAINER_ONLY & r
    assert "weightsync_syncs" in r and "weightsync_syncs" in t


def test_generation_records_latency_tokens_and_in_flight_only_for_answers():
    import pytest

    reg = SyncMetrics("rollout").registry
    rm = RolloutMetrics(reg)

    def value(name, endpoint="grpc_generate"):
        return reg.get_sample_value(name, {"role": "rollout", "endpoint": endpoint})

    assert value("weightsync_generation_requests_in_flight", "http_completions") == 0  # every endpoint from start
    with rm.generation("grpc_generate") as done:
        assert value("weightsync_generation_requests_in_flight") == 1
        done(7, 12)
    assert value("weightsync_generation_requests_in_flight") == 0
    assert value("weightsync_generation_duration_seconds_count") == 1
    assert (value("weightsync_prompt_tokens_total"), value("weightsync_completion_tokens_total")) == (7, 12)
    with pytest.raises(RuntimeError), rm.generation("grpc_generate"):
        raise RuntimeError("engine failed")
    assert value("weightsync_generation_requests_in_flight") == 0
    assert value("weightsync_generation_duration_seconds_count") == 1 and value("weightsync_prompt_tokens_total") == 7
    assert value("weightsync_generation_duration_seconds_count", "http_completions") == 0
    with pytest.raises(ValueError, match="endpoint='grpc' must be one of"), rm.generation("grpc"):
        pass
