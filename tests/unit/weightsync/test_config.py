import argparse

import pytest

from rollout_svc.config import RolloutConfig
from trainer_svc.config import TrainerConfig
from weightsync.config import ConfigError, add_arguments, resolve


def _resolve(cls, argv, env=None, prefix="WS_TRAINER"):
    p = argparse.ArgumentParser(allow_abbrev=False)  # as the services' `serve` parses (weightsync/service_cli.py)
    add_arguments(p, cls, prefix)
    return resolve(cls, p.parse_args(argv), prefix, env or {})


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("bucket_mb: 8\ntp: 1\nsync_timeout_s: 11\nrollouts: [a:1]\n")
    cfg = _resolve(
        TrainerConfig,
        ["--config", str(f), "--bucket-mb", "32"],
        {"WS_TRAINER_BUCKET_MB": "16", "WS_TRAINER_SYNC_TIMEOUT_S": "22"},
    )
    assert cfg.bus.bucket_mb == 32  # flag beats env and file
    assert cfg.bus.sync_timeout_s == 22.0  # env beats file
    assert cfg.fleet.rollouts == ["a:1"]  # file beats default
    assert cfg.bus.rpc_timeout_s == 30.0  # default
    assert cfg.bus.delta_link_gbps == 400.0  # auto on nccl: deltas below 50 GB/s
    assert _resolve(TrainerConfig, [], {"WS_TRAINER_DELTA_LINK_GBPS": "0"}).bus.delta_link_gbps == 0.0


def test_env_config_file_and_bool_and_list(tmp_path):
    f = tmp_path / "c.json"
    f.write_text('{"auto_sync_new_rollouts": false}')
    cfg = _resolve(TrainerConfig, [], {"WS_TRAINER_CONFIG": str(f), "WS_TRAINER_ROLLOUTS": "h:1, h:2"})
    assert cfg.fleet.auto_sync_new_rollouts is False and cfg.fleet.rollouts == ["h:1", "h:2"]


@pytest.mark.parametrize(
    "argv, env, match",
    [
        (["--grpc-address", "nohostport"], {}, "grpc_address"),
        ([], {"WS_TRAINER_TP": "two"}, "tp: 'two' is not a valid int"),
        (["--tp", "0"], {}, "tp=0 must be >= 1"),
        (["--vpp", "2"], {}, "vpp=2 needs pp >= 2"),
        (["--backend", "hf", "--tp", "2"], {}, "backend=hf runs one process"),
        ([], {"WS_TRAINER_AUTO_SYNC_NEW_ROLLOUTS": "maybe"}, "not a boolean"),
        ([], {"WS_TRAINER_TRANSPORT": "carrier-pigeon"}, "transport"),
        (["--delta-link-gbps", "-1"], {}, r"delta_link_gbps=-1.0 must be >= 0 \(Gb/s below which auto"),
        ([], {"WS_TRAINER_DELTA_LINK_GBPS": "-0.5"}, "delta_link_gbps=-0.5 must be >= 0"),
    ],
)
def test_errors_name_the_field(argv, env, match):
    with pytest.raises(ConfigError, match=match):
        _resolve(TrainerConfig, argv, env)


def test_unknown_file_key_is_rejected(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("bucket_mbb: 8\n")
    with pytest.raises(ConfigError, match="unknown field.*bucket_mbb"):
        _resolve(TrainerConfig, ["--config", str(f)])


def test_rollout_config_validation():
    with pytest.raises(ConfigError, match="engine=builtin runs one rank"):
        _resolve(RolloutConfig, ["--tp", "2"], prefix="WS_ROLLOUT")
    cfg = _resolve(RolloutConfig, ["--apply-mode", "inplace"], prefix="WS_ROLLOUT")
    assert cfg.bus.apply_mode == "inplace"


def test_nested_file_sections_and_flat_names_agree(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("bus:\n  bucket_mb: 8\noptim: {lr: 0.5}\nresume: false\n")
    cfg = _resolve(TrainerConfig, ["--config", str(f)])
    assert (cfg.bus.bucket_mb, cfg.optim.lr, cfg.checkpoint.resume) == (8, 0.5, False)
    f.write_text("bus:\n  lr: 0.5\n")
    with pytest.raises(ConfigError, match="bus.lr is not a field of section bus"):
        _resolve(TrainerConfig, ["--config", str(f)])


def test_shared_sections_keep_each_service_defaults():
    t, r = _resolve(TrainerConfig, []), _resolve(RolloutConfig, [], prefix="WS_ROLLOUT")
    assert (t.server.grpc_address, r.server.grpc_address) == ("127.0.0.1:50051", "127.0.0.1:50061")
    assert TrainerConfig.from_flat(bucket_mb=8, log_level="DEBUG").bus.bucket_mb == 8


def test_load_megatron_checkpoint_flag_env_file_and_backend(tmp_path):
    assert _resolve(TrainerConfig, []).checkpoint.load_megatron_checkpoint == ""
    cfg = _resolve(
        TrainerConfig, ["--load-megatron-checkpoint", "/ck/a"], {"WS_TRAINER_LOAD_MEGATRON_CHECKPOINT": "/ck/b"}
    )
    assert cfg.checkpoint.load_megatron_checkpoint == "/ck/a"
    assert (
        _resolve(
            TrainerConfig, [], {"WS_TRAINER_LOAD_MEGATRON_CHECKPOINT": "/ck/b"}
        ).checkpoint.load_megatron_checkpoint
        == "/ck/b"
    )
    f = tmp_path / "c.yaml"
    f.write_text("checkpoint:\n  load_megatron_checkpoint: /ck/c\n")
    assert _resolve(TrainerConfig, ["--config", str(f)]).checkpoint.load_megatron_checkpoint == "/ck/c"
    with pytest.raises(ConfigError, match="load_megatron_checkpoint needs backend=megatron"):
        _resolve(TrainerConfig, ["--backend", "hf", "--load-megatron-checkpoint", "/ck/a"])


@pytest.mark.parametrize("cls, prefix", [(TrainerConfig, "WS_TRAINER"), (RolloutConfig, "WS_ROLLOUT")])
def test_the_token_is_never_a_flag_but_env_and_file_set_it(cls, prefix, tmp_path):
    """A flag's value is in every local user's process list: the token comes from env, file or auth_token_file."""
    from rollout_svc.cli import SERVICE as ROLLOUT_CLI
    from trainer_svc.cli import SERVICE as TRAINER_CLI

    cli = TRAINER_CLI if cls is TrainerConfig else ROLLOUT_CLI
    with pytest.raises(SystemExit) as ei:  # not even as an abbreviation of --auth-token-file
        cli.build_parser().parse_args(["serve", "--auth-token", "s3cret"])
    assert ei.value.code == 2
    assert _resolve(cls, [], {f"{prefix}_AUTH_TOKEN": "from-env"}, prefix=prefix).auth.auth_token == "from-env"
    f = tmp_path / "c.yaml"
    f.write_text("auth: {auth_token: from-file}\n")
    assert _resolve(cls, ["--config", str(f)], prefix=prefix).auth.auth_token == "from-file"


def test_the_debug_switches_are_one_section_with_the_services_precedence(tmp_path):
    from weightsync.debug import Switches

    f = tmp_path / "c.yaml"
    f.write_text("debug: {nccl_library: /opt/from-file.so, profile_syncs: /tmp/from-file, fp8_gpu_convert: false}\n")
    cfg = _resolve(
        TrainerConfig,
        ["--config", str(f), "--nccl-library", "/opt/libnccl.so.2"],
        {"WS_TRAINER_PROFILE_SYNCS": "/tmp/from-env", "WS_TRAINER_NCCL_LIBRARY": "/opt/from-env.so"},
    )
    assert cfg.debug.switches() == Switches(
        fp8_gpu_convert=False,  # file beats default
        profile_syncs="/tmp/from-env",  # env beats file
        nccl_library="/opt/libnccl.so.2",  # flag beats env and file
        nccl_bus="",  # default
    )
    rollout = _resolve(RolloutConfig, [], {"WS_ROLLOUT_NCCL_BUS": "tests.support.gloo_nccl:GlooNcclBus"}, "WS_ROLLOUT")
    assert rollout.debug.switches() == Switches(nccl_bus="tests.support.gloo_nccl:GlooNcclBus")
    sglang = _resolve(
        RolloutConfig, ["--no-sglang-peer-reads"], {"WS_ROLLOUT_SGLANG_ROLLOUT_WRITES": "false"}, "WS_ROLLOUT"
    )
    assert sglang.debug.switches() == Switches(sglang_peer_reads=False, sglang_rollout_writes=False)
    with pytest.raises(ConfigError, match="nccl_bus='gloo' must be module:attr"):
        _resolve(TrainerConfig, [], {"WS_TRAINER_NCCL_BUS": "gloo"})
