"""Checkpoint conversion: HF directory <-> Megatron checkpoint at a given TP/PP/VPP.

The Megatron side is per-rank `torch.save` of each model chunk's state_dict (plus a JSON manifest
and the HF config), under the local or the Transformer-Engine spec's parameter names (`--names`;
to-hf reads either). Such a checkpoint is tied to its TP/PP/VPP layout; for one that loads at any
layout, save a Megatron distributed (torch_dist) checkpoint from the trainer (`dist_ckpt.py`).

Both directions run one process per model-parallel rank. Called outside torchrun with tp*pp > 1,
`main` relaunches itself under `torch.distributed.run`.

    python -m trainer_svc.actor.megatron.convert to-megatron --hf DIR --out CKPT --tp 2 --pp 2
    python -m trainer_svc.actor.megatron.convert to-megatron --hf MOE_DIR --out CKPT --ep 2 --mtp deepseek
    python -m trainer_svc.actor.megatron.convert to-megatron --hf DIR --out CKPT --pp 2 --names te
    python -m trainer_svc.actor.megatron.convert to-hf --ckpt CKPT --out DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

FORMAT = "weightsync-megatron-v1"
MANIFEST = "megatron_checkpoint.json"


def _rank_key(actor) -> tuple[int, ...]:
    r = actor.rmap
    if actor.par.ep == 1 and actor.par.expert_tp == actor.par.tp:
        return r.tp_rank, r.pp_rank
    return r.tp_rank, r.pp_rank, r.ep_rank, r.etp_rank


def _rank_file(ckpt: Path, key: tuple[int, ...]) -> Path:
    tail = "".join(f"_{k:03d}" for k in key[2:])
    return ckpt / f"mp_rank_{key[0]:02d}_{key[1]:03d}{tail}.pt"


def _writes_its_file(key: tuple[int, ...]) -> bool:
    """Whether this rank is the lowest one holding `key` (the others hold the same weights)."""
    import torch
    import torch.distributed as dist

    me = torch.tensor(list(key) + [0] * (4 - len(key)), dtype=torch.int64)
    table = [torch.zeros_like(me) for _ in range(dist.get_world_size())]
    dist.all_gather(table, me)
    return next(i for i, t in enumerate(table) if torch.equal(t, me)) == dist.get_rank()


def read_manifest(ckpt: str) -> dict:
    path = Path(ckpt) / MANIFEST
    if not path.is_file():
        raise ValueError(f"ckpt {ckpt}: no {MANIFEST}; not a checkpoint written by `convert to-megatron`")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"ckpt {ckpt}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def _chunk_state(actor, chunk, names: str) -> dict:
    from trainer_svc.actor.megatron.rules.te_spec import te_chunk_state_dict

    sd = chunk.state_dict()
    if names == "local":
        return sd
    global_layer = {i: layer.layer_number - 1 for i, layer in enumerate(chunk.decoder.layers)}
    return te_chunk_state_dict(sd, actor.spec.dims, global_layer)


def _load_chunk(chunk, sd: dict) -> None:
    """Load a chunk's plain state dict written under either spec's names (TE `_extra_state` is
    dropped; the local layers' own, which hold nothing, are kept)."""
    from trainer_svc.actor.megatron.rules.te_spec import is_extra_state, local_state_dict

    sd = local_state_dict(sd)
    for k, v in chunk.state_dict().items():
        if is_extra_state(k):
            sd.setdefault(k, v)
    chunk.load_state_dict(sd, strict=True)


def to_megatron(
    hf_dir: str,
    out: str,
    tp: int,
    pp: int,
    vpp: int,
    ep: int = 1,
    etp: int | None = None,
    mtp: str = "off",
    names: str = "local",
) -> None:
    import torch
    import torch.distributed as dist

    from trainer_svc.actor.megatron.actor import MegatronActor

    actor = MegatronActor.from_pretrained(hf_dir, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, mtp=mtp)
    ckpt = Path(out)
    key = _rank_key(actor)
    if _writes_its_file(key):
        ckpt.mkdir(parents=True, exist_ok=True)
        torch.save({"chunks": [_chunk_state(actor, chunk, names) for chunk in actor.model]}, _rank_file(ckpt, key))
    if actor.rmap.rank == 0:
        actor.config.save_pretrained(str(ckpt))
        (ckpt / MANIFEST).write_text(
            json.dumps(
                {
                    "format": FORMAT,
                    "family": actor.family,
                    "tp": tp,
                    "pp": pp,
                    "vpp": vpp,
                    "ep": ep,
                    "etp": actor.par.expert_tp,
                    "mtp": mtp,
                    "names": names,
                    "world": dist.get_world_size(),
                },
                indent=2,
            )
        )
    dist.barrier()


def to_hf(ckpt: str, out: str, dtype: str) -> None:
    import torch
    from transformers import AutoConfig

    from trainer_svc.actor.megatron.actor import MegatronActor
    from weightsync.bus.dtypes import parse_dtype

    meta = read_manifest(ckpt)
    config = AutoConfig.from_pretrained(ckpt, local_files_only=True)
    actor = MegatronActor(
        config,
        tp=meta["tp"],
        pp=meta["pp"],
        vpp=meta["vpp"],
        ep=meta.get("ep", 1),
        etp=meta.get("etp"),
        mtp=meta.get("mtp", "off"),
        export_dtype=parse_dtype(dtype),
        init_weights=False,
    )
    path = _rank_file(Path(ckpt), _rank_key(actor))
    if not path.is_file():
        raise ValueError(
            f"ckpt {ckpt}: missing {path.name} for rank {actor.rmap.rank} (TP rank {actor.rmap.tp_rank}, "
            f"PP rank {actor.rmap.pp_rank}, EP rank {actor.rmap.ep_rank})"
        )
    state = torch.load(path, map_location="cpu", weights_only=True)
    if len(state["chunks"]) != len(actor.model):
        raise ValueError(
            f"ckpt {ckpt}: {path.name} has {len(state['chunks'])} chunks, VPP={meta['vpp']} needs {len(actor.model)}"
        )
    for chunk, sd in zip(actor.model, state["chunks"]):
        _load_chunk(chunk, sd)
    if actor.rmap.rank == 0:
        actor.save_hf(out)
        actor.shutdown()
    else:
        actor.worker_loop()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="trainer-svc convert", description="HF <-> Megatron checkpoint conversion")
    sub = ap.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("to-megatron", help="HF safetensors directory -> Megatron checkpoint at TP/PP/VPP")
    a.add_argument("--hf", required=True, help="HF directory (config.json + *.safetensors)")
    a.add_argument("--out", required=True, help="checkpoint directory to write")
    a.add_argument("--tp", type=int, default=1)
    a.add_argument("--pp", type=int, default=1)
    a.add_argument("--vpp", type=int, default=1)
    a.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    a.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: --tp)")
    a.add_argument(
        "--mtp",
        default="off",
        choices=("off", "deepseek", "mimo"),
        help="carry the checkpoint's MTP layers, named DeepSeek-V3 or MiMo style",
    )
    a.add_argument(
        "--names",
        default="local",
        choices=("local", "te"),
        help="parameter names in the written state dicts: the local layer spec's, or the "
        "Transformer-Engine spec's (fused norms, TEGroupedMLP experts; to-hf reads both)",
    )
    b = sub.add_parser("to-hf", help="Megatron checkpoint -> HF directory loadable by transformers")
    b.add_argument("--ckpt", required=True, help="checkpoint directory written by to-megatron")
    b.add_argument("--out", required=True, help="HF directory to write")
    b.add_argument("--dtype", default="float32", help="dtype of the written tensors (float32, bfloat16, ...)")
    return ap


def _world_needed(args) -> int:
    if args.direction == "to-megatron":
        # both the dense (tp x dp x pp) and the expert (etp x ep x edp x pp) grids must tile the world
        return math.lcm(args.tp * args.pp, (args.etp or args.tp) * args.ep * args.pp)
    meta = read_manifest(args.ckpt)
    return meta.get("world", meta["tp"] * meta["pp"])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    need = _world_needed(args)
    if "WORLD_SIZE" not in os.environ and need > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={need}",
            "-m",
            "trainer_svc.actor.megatron.convert",
            *argv,
        ]
        return subprocess.run(cmd, check=False).returncode
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) % need:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} is not a multiple of {need} (the layout's world)")
    if args.direction == "to-megatron":
        to_megatron(args.hf, args.out, args.tp, args.pp, args.vpp, args.ep, args.etp, args.mtp, args.names)
    else:
        to_hf(args.ckpt, args.out, args.dtype)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
