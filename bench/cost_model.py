"""Fleet cost model: predicted weight-sync time, one sender (rank 0) against every owner sending.

    python bench/cost_model.py --model qwen3-235b-a22b --dtype bf16 \
        --trainer tp=4,pp=8,ep=8,nodes=8 --fleet replicas=16,tp=8,receiver=full --links nic_gbit=400
    python bench/cost_model.py --table        # the tables of docs/BENCHMARKS.md "Fleet cost model"
    python bench/cost_model.py --calibration  # prediction against every recorded GPU measurement (and the
                                              # SGLang tp_size=2 runs: sharded receivers, once recorded)

The model (pure Python; docs/BENCHMARKS.md "Fleet cost model" states it in prose):

    sync   = control + stream                       (control only through the services)
    control = plan + prepare + commit: the services' round trips measured at ~340 tensors (GPUs), plus the
              control host work at scale, measured on a CPU (bench/control_plane.py) or per bucket
    stream = fill + steady + drain
    steady = max over every resource that the bytes cross, all pipelined against each other:
        each sender's egress     bytes_i / link + buckets_i * (msg latency + ring hops * hop latency)
        each sender's gather     bytes it receives from trainer peers / (NVLink or NIC)
        each sender's host work  pack traffic / HBM + checksum + tensors_i * per-tensor cost
        each receiving GPU       ingress bytes / link, local hand-off over NVLink, apply work
    fill / drain = one bucket's pack (on the slowest sender, or on the first sender ready when a
                   receiver is the bottleneck) / one bucket's apply on a receiver

Senders. SINGLE: global rank 0 assembles and sends everything (today's export); it first receives
every byte that other GPUs own: over NVLink from its node, over its NIC from other nodes. MULTI:
each pipeline stage's leader sends that stage's non-expert tensors (after a TP gather over NVLink)
and each expert-parallel rank of the stage sends its own experts, all at once.

Receivers (`Fleet.receiver`), explicit because they bound everything once senders scale out:
- full:  each replica has one receiving GPU that takes every byte over its own link, then hands
         the bucket to its TP ranks over NVLink (today's rollout-svc);
- split: each of the replica's tp GPUs receives 1/tp over its own NIC, then an NVLink all-gather
         gives every rank the full tensors (not built);
- shard: each engine GPU receives only its own 1/tp shard (sender-side resharding, not built):
         TP slices of the dense tensors, whole experts for its expert-parallel share.
NCCL broadcast runs a ring: fan-out to R receivers costs the bytes once at the link rate plus a
pipeline fill of R-1 hops per bucket; every receiver forwards, so the sender's egress does not grow.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

if __package__ in (None, ""):  # `python bench/cost_model.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.model_arch import BF16, DTYPES, FP8, Footprint, arch, footprint  # noqa: E402

GIB = 1 << 30
SINGLE, MULTI = "single", "multi"
RECEIVERS = ("full", "split", "shard")


@dataclass(frozen=True)
class Links:
    """Per-GPU link figures. Bandwidths in GB/s (1e9 B/s) unless the name says Gb/s."""

    nvlink_gbs: float = 367.0  # NCCL broadcast 1->1 at 4 GiB, H200 NV18, measured (not the 450 nominal)
    nic_gbit: float = 400.0  # one NIC per GPU (InfiniBand NDR / RoCE 400G)
    nic_eff: float = 0.92  # ASSUMED NCCL efficiency over the NIC: no multi-node run measured yet
    pcie_gbs: float = 64.0  # Gen5 x16, per direction; GPUDirect RDMA crosses it
    pcie_eff: float = 0.85  # ASSUMED
    hop_s: float = 10e-6  # ASSUMED ring hop latency per bucket (inter-node)

    def net_gbs(self) -> float:
        return min(self.nic_gbit / 8 * self.nic_eff, self.pcie_gbs * self.pcie_eff)


@dataclass(frozen=True)
class Calibration:
    """Testbed constants. Provenance of each in bench/cost_calibration.py and docs/BENCHMARKS.md."""

    msg_latency_s: float = 25e-6  # alpha of the NCCL broadcast message-size curve (NV18)
    hbm_rw_gbs: float = 3800.0  # D2D copy, read + write counted (copy bound of the IPC bench)
    checksum_gbs: float = 2773.0  # fused Triton bucket checksum
    per_tensor_s: float = 27.3e-6  # host cost per HF tensor, each side (pack / apply); fitted
    plan_prepare_s: float = 11.1e-3  # plan + prepare at ref_tensors (7B, services, median)
    commit_s: float = 2.1e-3
    ref_tensors: int = 339
    ref_buckets: int = 15  # the 7B's at 1 GiB: its measured control already pays for them
    ipc_bucket_s: float = 1.13e-3  # CUDA IPC hand-off per bucket (map, ack, syncs); fitted
    ipc_rpc_bucket_s: float = 0.79e-3  # PushBucket round trip per bucket through the services; fitted


CAL = Calibration()


@dataclass(frozen=True)
class Trainer:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    nodes: int = 1
    gpus_per_node: int = 8
    weights: str = BF16  # dtype the trainer holds: bf16, or fp32 (the hf backend: cast on export)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def validate(self, moe: bool) -> None:
        for f in ("tp", "pp", "ep", "nodes", "gpus_per_node"):
            if getattr(self, f) < 1:
                raise ValueError(f"trainer {f}={getattr(self, f)}: must be >= 1")
        if self.weights not in ("bf16", "fp32"):
            raise ValueError(f"trainer weights={self.weights!r}: expected bf16 or fp32")
        if self.tp > self.gpus_per_node:
            raise ValueError(f"trainer tp={self.tp} > gpus_per_node={self.gpus_per_node}: keep TP inside a node")
        if self.gpus % (self.tp * self.pp):
            raise ValueError(
                f"trainer tp*pp={self.tp * self.pp} does not divide {self.gpus} GPUs (nodes*gpus_per_node)"
            )
        if self.ep > 1 and not moe:
            raise ValueError(f"trainer ep={self.ep} on a dense model: set ep=1")
        if (self.gpus // self.pp) % self.ep:
            raise ValueError(f"trainer ep={self.ep} does not divide the {self.gpus // self.pp} GPUs of a stage")


@dataclass(frozen=True)
class Fleet:
    replicas: int = 1
    tp: int = 1  # GPUs per engine replica
    gpus_per_node: int = 8
    receiver: str = "full"
    same_node: bool = False  # trainer and rollout GPUs on one NVLink domain (the 2-GPU testbed)

    def validate(self) -> None:
        if self.replicas < 1 or self.tp < 1:
            raise ValueError(f"fleet replicas={self.replicas} tp={self.tp}: both must be >= 1")
        if self.receiver not in RECEIVERS:
            raise ValueError(f"fleet receiver={self.receiver!r}: expected one of {', '.join(RECEIVERS)}")
        if self.receiver == "split" and self.tp > self.gpus_per_node and not self.same_node:
            raise ValueError(
                f"fleet receiver=split needs the replica inside one NVLink domain: "
                f"tp={self.tp} > gpus_per_node={self.gpus_per_node}; use receiver=shard"
            )


@dataclass(frozen=True)
class Sync:
    bucket_bytes: int = GIB
    checksum: bool = True
    services: bool = True  # through trainer-svc / rollout-svc: adds the control phases
    transport: str = "nccl"  # nccl, or ipc (colocated, one GPU, 1->1 only)


@dataclass
class Sender:
    bytes: float = 0.0
    tensors: int = 0
    gather_nvlink: float = 0.0  # bytes received from trainer peers over NVLink
    gather_nic: float = 0.0  # ... and over the NIC


@dataclass
class Prediction:
    seconds: float
    control_s: float
    stream_s: float
    terms: dict[str, float] = field(default_factory=dict)
    binding: str = ""
    senders: int = 1
    max_sender_bytes: float = 0.0
    total_bytes: float = 0.0


def _pack_traffic(fp: Footprint, trainer: Trainer) -> float:
    """HBM bytes moved per output byte to pack a bucket: read the source, write the bucket."""
    src = 4.0 if trainer.weights == "fp32" else 2.0
    dst = 1.0 if fp.dtype == FP8 else 2.0
    return 1.0 + src / dst


def _stage_parts(fp: Footprint, pp: int) -> list[list]:
    """Megatron's even split of layers over stages; embedding on the first, head on the last."""
    per = math.ceil(fp.arch.layers / pp)
    stages = [[] for _ in range(pp)]
    for i, p in enumerate(fp.layers):
        stages[min(i // per, pp - 1)].append(p)
    stages[0].insert(0, fp.embedding)
    stages[-1].append(fp.head)
    return stages


def senders(fp: Footprint, tr: Trainer, mode: str) -> list[Sender]:
    stages = _stage_parts(fp, tr.pp)
    dense = [sum(p.dense_bytes for p in s) for s in stages]
    expert = [sum(p.expert_bytes for p in s) for s in stages]
    dense_t = [sum(p.dense_tensors for p in s) for s in stages]
    expert_t = [sum(p.expert_tensors for p in s) for s in stages]
    if mode == MULTI:
        out = []
        for s in range(tr.pp):
            for e in range(tr.ep):
                snd = Sender(expert[s] / tr.ep, math.ceil(expert_t[s] / tr.ep))
                if e == 0:  # the stage leader also sends the stage's non-expert tensors
                    snd.bytes += dense[s]
                    snd.tensors += dense_t[s]
                    snd.gather_nvlink = dense[s] * (tr.tp - 1) / tr.tp
                out.append(snd)
        return out
    if mode != SINGLE:
        raise ValueError(f"mode {mode!r}: expected {SINGLE} or {MULTI}")
    # rank 0 owns 1/tp of stage 0's dense bytes and 1/ep of its experts; the rest comes to it
    stage_gpus = tr.gpus // tr.pp
    on_node = []  # fraction of each stage's GPUs that share rank 0's node
    for s in range(tr.pp):
        lo, hi = s * stage_gpus, (s + 1) * stage_gpus
        on_node.append(max(0, min(hi, tr.gpus_per_node) - lo) / stage_gpus)
    total = fp.bytes
    local = sum((dense[s] + expert[s]) * on_node[s] for s in range(tr.pp))
    own = dense[0] / tr.tp + expert[0] / tr.ep
    return [Sender(total, fp.tensors, gather_nvlink=local - own, gather_nic=total - local)]


def _receiver_bytes(total: float, fleet: Fleet) -> tuple[float, float]:
    """(bytes each receiving GPU takes over its link, bytes it exchanges over NVLink after)."""
    t = fleet.tp
    if fleet.receiver == "full":
        return total, total * (t - 1) / t
    if fleet.receiver == "split":
        return total / t, total * (t - 1) / t
    return total / t, 0.0


def control_seconds(fp: Footprint, cal: Calibration = CAL, bucket_bytes: int = GIB) -> float:
    """Steady-state control of a sync: the services' round trips and fixed work as measured on GPUs at
    the reference model (plan + prepare + commit), plus the control host work at `fp`'s scale, measured
    on a CPU where bench/control_plane.py has a row for it (`control_source`) and otherwise predicted
    from the measured cost per bucket beyond the reference's buckets. The layout is sent and validated
    once (first sync, restarted rollout), not per sync: steady state costs per bucket, not per tensor."""
    from bench import control_measured

    measured = control_measured.row(fp.arch.name, fp.dtype)
    if measured is not None:
        return cal.plan_prepare_s + cal.commit_s + measured.steady_s
    extra = control_measured.buckets(fp.bytes, bucket_bytes) - cal.ref_buckets
    return cal.plan_prepare_s + cal.commit_s + control_measured.per_bucket_s() * max(0, extra)


def control_source(fp: Footprint) -> str:
    """ "measured" (on a CPU, bench/control_plane.py) or "predicted" (per bucket): whence control_seconds."""
    from bench import control_measured

    return "measured" if control_measured.row(fp.arch.name, fp.dtype) is not None else "predicted"


def predict(
    fp: Footprint,
    tr: Trainer,
    fleet: Fleet,
    links: Links = Links(),
    sync: Sync = Sync(),
    mode: str = MULTI,
    cal: Calibration = CAL,
) -> Prediction:
    tr.validate(fp.arch.moe)
    fleet.validate()
    if sync.bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={sync.bucket_bytes}: must be >= 1")
    hbm, total = cal.hbm_rw_gbs * 1e9, fp.bytes
    pack = _pack_traffic(fp, tr)
    csum = (1.0 / (cal.checksum_gbs * 1e9)) if sync.checksum else 0.0
    control = control_seconds(fp, cal, sync.bucket_bytes) if sync.services else 0.0
    if sync.transport == "ipc":
        return _predict_ipc(fp, tr, fleet, sync, cal, pack, csum, control)
    if sync.transport != "nccl":
        raise ValueError(f"transport {sync.transport!r}: expected nccl or ipc")

    nv = links.nvlink_gbs * 1e9
    link = nv if fleet.same_node else links.net_gbs() * 1e9
    bucket_lat = cal.msg_latency_s + (fleet.replicas - 1) * links.hop_s
    terms: dict[str, float] = {}
    snds = senders(fp, tr, mode)
    crit_fill, crit_steady, first_fill = 0.0, -1.0, math.inf
    for s in snds:
        nb = max(1, math.ceil(s.bytes / sync.bucket_bytes))
        host = s.bytes * pack / hbm + s.bytes * csum + s.tensors * cal.per_tensor_s
        cand = {
            "sender egress": s.bytes / link + nb * bucket_lat,
            "sender gather": s.gather_nvlink / nv + s.gather_nic / (links.net_gbs() * 1e9),
            "sender host": host,
        }
        for k, v in cand.items():
            terms[k] = max(terms.get(k, 0.0), v)
        if max(cand.values()) > crit_steady:  # the slowest sender: its own first pack is on the critical path
            crit_steady, crit_fill = max(cand.values()), host / nb
        first_fill = min(first_fill, host / nb)
    rx, local = _receiver_bytes(total, fleet)
    applied, applied_tensors = total, fp.tensors
    if fleet.receiver == "shard":  # TP slices of every dense tensor; experts expert-parallel over the GPUs
        expert_t = sum(p.expert_tensors for p in fp.parts())
        applied, applied_tensors = total / fleet.tp, fp.tensors - expert_t + math.ceil(expert_t / fleet.tp)
    rx_host = applied * (2.0 / hbm + csum) + applied_tensors * cal.per_tensor_s
    terms["receiver ingress"] = rx / link
    terms["receiver NVLink"] = local / nv
    terms["receiver host"] = rx_host
    binding = max(terms, key=terms.get)
    rx_steady = max(terms["receiver ingress"], terms["receiver NVLink"], rx_host)
    # receivers start on whichever sender's first bucket is ready; a slow sender adds its own fill
    drain = rx_host / max(1, math.ceil(applied / sync.bucket_bytes))
    stream = max(crit_fill + crit_steady, first_fill + rx_steady) + drain
    terms["fill+drain"] = stream - max(terms.values())
    return Prediction(control + stream, control, stream, terms, binding, len(snds), max(s.bytes for s in snds), total)


def _predict_ipc(fp, tr, fleet, sync, cal, pack, csum, control) -> Prediction:
    if fleet.replicas != 1 or fleet.tp != 1 or tr.gpus != 1:
        raise ValueError("transport ipc: colocated 1 -> 1 on one GPU only (trainer 1 GPU, fleet replicas=1,tp=1)")
    total, hbm = fp.bytes, cal.hbm_rw_gbs * 1e9
    nb = max(1, math.ceil(total / sync.bucket_bytes))
    # pack and the engine's copy share one GPU's HBM, so they add instead of overlapping
    # (no per-tensor host term: the hand-off constant was fitted with it folded in)
    terms = {
        "copies": total * (pack + 2.0) / hbm + 2 * total * csum,
        "hand-off": nb * (cal.ipc_bucket_s + (cal.ipc_rpc_bucket_s if sync.services else 0.0)),
    }
    stream = sum(terms.values())
    return Prediction(control + stream, control, stream, terms, "copies", 1, total, total)


# ---------------------------------------------------------------------------------------------- CLI


def _kv(text: str, cls, flag: str, aliases: dict[str, str] | None = None):
    names = {f.name: f.type for f in fields(cls)}
    out = {}
    for item in filter(None, text.split(",")):
        if "=" not in item:
            raise SystemExit(f"{flag}: {item!r} is not key=value (keys: {', '.join(names)})")
        k, v = item.split("=", 1)
        k = (aliases or {}).get(k, k)
        if k not in names:
            raise SystemExit(f"{flag}: unknown key {k!r} (keys: {', '.join(names)})")
        typ = names[k]
        try:
            out[k] = (
                (v.lower() in ("1", "true", "yes"))
                if typ in (bool, "bool")
                else int(v)
                if typ in (int, "int")
                else float(v)
                if typ in (float, "float")
                else v
            )
        except ValueError:
            raise SystemExit(
                f"{flag}: {k}={v!r} is not {'an integer' if typ in (int, 'int') else 'a number'}"
            ) from None
    return replace(cls(), **out)


def _fmt(p: Prediction) -> str:
    lines = [
        f"sync {p.seconds:.3f} s = control {p.control_s:.3f} s + stream {p.stream_s:.3f} s "
        f"({p.senders} sender(s), largest {p.max_sender_bytes / 1e9:.1f} GB of {p.total_bytes / 1e9:.1f} GB; "
        f"bound by {p.binding})"
    ]
    lines += [f"  {k:18s} {v:9.4f} s" for k, v in p.terms.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-235b-a22b")
    ap.add_argument("--dtype", default=BF16, choices=DTYPES)
    ap.add_argument("--trainer", default="tp=4,pp=8,ep=8,nodes=8", help="tp,pp,ep,nodes,gpus_per_node,weights")
    ap.add_argument("--fleet", default="replicas=16,tp=8", help="replicas,tp,gpus_per_node,receiver,same_node")
    ap.add_argument("--links", default="", help="nvlink_gbs,nic_gbit,nic_eff,pcie_gbs,pcie_eff,hop_s")
    ap.add_argument("--sync", default="", help="bucket_bytes,checksum,services,transport")
    ap.add_argument("--table", action="store_true", help="print the docs tables (markdown)")
    ap.add_argument("--calibration", action="store_true", help="print predicted vs measured GPU runs")
    a = ap.parse_args(argv)
    if a.table or a.calibration:
        from bench import cost_tables

        if a.calibration:
            print(cost_tables.calibration_markdown() + "\n\n" + cost_tables.shard_markdown())
        else:
            print(cost_tables.tables_markdown())
        return 0
    try:
        fp = footprint(arch(a.model), a.dtype)
        tr, fl = _kv(a.trainer, Trainer, "--trainer"), _kv(a.fleet, Fleet, "--fleet")
        ln, sy = _kv(a.links, Links, "--links"), _kv(a.sync, Sync, "--sync")
        for mode in (SINGLE, MULTI):
            print(f"{mode}-sender: " + _fmt(predict(fp, tr, fl, ln, sy, mode)))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
