"""SGLang's real Engine on a GPU behind `rollout-svc --engine sglang`, synced from a megatron-core trainer
through the services and `wsctl` (issue 34). Run by bench/sglang_live.sh on a GPU host; needs SGLang
importable (its wheel and light deps) and, where sgl_kernel is absent, the harness shim
(tests/support/sgl_kernel_shim.py, installed by sitecustomize in every process).

One trainer (megatron, bf16) on cuda:0, one SGLang rollout `s0` and one built-in-engine rollout `b0` on
the same GPU; with two GPUs visible also `s1` (SGLang) and `b1` (built-in) on cuda:1 for NCCL. The
trainer's weights: `--peaked DIR` (bench/peaked_model.py's checkpoints `a` and `b`: a small Qwen2 trained
to decisive next-token margins, so greedy tokens can be compared strictly) or random weights of `--model`'s
shape. Per transport (ipc -> s0, tcp -> s0, nccl -> s1):
  1. the trainer gets new weights (`wsctl load`: peaked `b` for tcp, `a` for nccl, or fresh random ones;
     the ipc run syncs the trainer's initial weights),
  2. the SGLang rollout generates the fixed prompts twice on its OLD weights (the second must hit the radix
     cache),
  3. `wsctl sync --rollout sX --transport T` (+ --reps timed re-syncs), then the built-in rollout likewise,
  4. it generates again: greedy tokens vs transformers (bf16, cuda) on `wsctl export`'s directory,
     max |log-prob| difference on SGLang's tokens, prefix_cache_hit on the first request after the
     sync (must be False: the radix cache was flushed), served version == the trainer's.
`--timing-model 1.5b` then restarts the services at that shape (random weights, ipc only) and times the
colocated sync into SGLang beside the built-in engine.
`--timing-dtype fp8-block`: those runs export block FP8 (the trainer's fp8-block), SGLang serving a block-FP8
checkpoint of the same random weights (`save_random_fp8`) and the built-in engine the bf16 one.
`--tp-size N`: SGLang's tp_size (every SGLang rollout; its ranks on GPUs 0..N-1 for ipc and tcp, beside the
trainer on cuda:0; nccl: rollout_layout), each run recording `tp_size` and the SGLang rollout's `bytes_per_rank`.
`--concurrency N` (before the services stop): N clients each send one greedy Generate of one prompt at
once, against the same N calls one after another, on the SGLang rollout and on the built-in one: the
tokens/s of each and their ratio (SGLang batches concurrent requests itself; the built-in engine
interleaves them step by step), and whether the concurrent answers equal the sequential ones.
Writes the JSON the issue asks for (date, device, engine_version, runs[...]) plus details, as it goes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("WS_LOCAL_OMP_THREADS", "8")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])

import torch  # noqa: E402

from bench import peaked_model  # noqa: E402
from bench.bench_services import write_config  # noqa: E402
from weightsync.control.client import channel, rollout_stub, trainer_stub  # noqa: E402
from weightsync.local.procs import start_rollout, start_trainer, wait_registered, wsctl  # noqa: E402
from weightsync.v1 import rollout_pb2  # noqa: E402

#: prompts for random weights (Qwen2.5 vocabulary); the peaked model brings its own (peaked_model.PROMPTS)
RANDOM_PROMPTS = [[9707, 11, 847, 829, 374, 1207, 16948, 13], [785, 6722, 315, 9625, 374], [16, 11, 17, 11, 18, 11, 19]]
N_NEW = 12
#: nats: below this, a greedy step is a tie between bf16 kernel stacks, not evidence of wrong weights
TIE_FLOOR = 0.05
SGLANG_ARGS = {
    "attention_backend": "triton",
    "sampling_backend": "pytorch",
    "disable_cuda_graph": "true",
    # 0.5.10 captures piecewise CUDA graphs by default, via sgl_kernel.weak_ref_tensor (absent here)
    "disable_piecewise_cuda_graph": "true",
    "mem_fraction_static": "0.25",
    "context_length": "2048",
    "grammar_backend": "none",
    "log_level": "warning",
}
#: transport -> (SGLang rollout, built-in rollout) it syncs; nccl needs a GPU of the rollouts' own
TARGETS = {"ipc": ("s0", "b0"), "tcp": ("s0", "b0"), "nccl": ("s1", "b1")}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save_random_hf(cfg_dir: Path, out: Path, seed: int) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.from_pretrained(cfg_dir)
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    m.save_pretrained(out)
    del m
    torch.cuda.empty_cache()
    return out


def save_random_fp8(bf16_dir: Path, out: Path, device: str = "cuda") -> Path:
    """`bf16_dir`'s weights as a block-FP8 checkpoint, written as DeepSeek-V3's are: every linear weight e4m3 beside
    its float32 `weight_scale_inv` (one per 128x128 block; weightsync's own fp8-block export, quantized on the GPU)
    and config.json with the `quantization_config` from which SGLang builds block-FP8 (Fp8LinearMethod) layers."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from weightsync.formats.fp8.export import export_tensors
    from weightsync.formats.fp8.spec import BLOCK_FP8, hf_quantization_config

    out.mkdir(parents=True, exist_ok=True)  # a later run at the same shape overwrites it, as save_random_hf does
    cfg = AutoConfig.from_pretrained(bf16_dir)
    cfg.quantization_config = hf_quantization_config(BLOCK_FP8)
    cfg.save_pretrained(out)
    for i, f in enumerate(sorted(bf16_dir.glob("*.safetensors"))):  # shard by shard: one in GPU memory at a time
        quantized = {n: t.contiguous() for n, t in export_tensors(load_file(f, device=device).items())}
        save_file(quantized, out / f"model-fp8-{i:05d}.safetensors", metadata={"format": "pt"})
        del quantized
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def copy_under(src: Path, dst: Path) -> Path:
    """`wsctl load` reads only under the trainer's data root (the temp dir here): load a copy from there."""
    shutil.copytree(src, dst)
    return dst


def ws(address: str, *args: str, timeout: float = 300.0) -> dict:
    p = wsctl("--address", address, "--json", *args, timeout=timeout)
    try:
        out = json.loads(p.stdout)
    except json.JSONDecodeError as exc:
        msg = f"wsctl {' '.join(args)} exited {p.returncode}: {p.stdout[-2000:]} {p.stderr[-2000:]}"
        raise RuntimeError(msg) from exc
    if p.returncode != 0:
        raise RuntimeError(f"wsctl {' '.join(args)} exited {p.returncode}: {json.dumps(out)[:3000]}")
    return out


def generate(stub, prompts) -> tuple[list[rollout_pb2.Sample], int]:
    req = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=p) for p in prompts],
        sampling=rollout_pb2.SamplingParams(max_new_tokens=N_NEW, temperature=0.0, n=1),
        return_logprobs=True,
    )
    resp = stub.Generate(req, timeout=120)
    return list(resp.samples), resp.version


@torch.no_grad()
def hf_reference(export_dir: str, prompts, samples) -> dict:
    """transformers (bf16, cuda) on the exported weights: its own greedy continuation of each prompt,
    and its log-probs of SGLang's tokens (teacher-forced), to compare with SGLang's."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.bfloat16).cuda().eval()
    out = {"hf_tokens": [], "sgl_tokens": [], "max_abs_logprob_diff": 0.0, "min_top2_margin": 1e9, "match": []}
    for prompt, s in zip(prompts, samples):
        ids = torch.tensor([prompt], device="cuda")
        g = m.generate(ids, max_new_tokens=N_NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
        hf_tok = g[0, len(prompt) :].tolist()
        sgl_tok = list(s.token_ids)
        full = torch.tensor([prompt + sgl_tok], device="cuda")
        lp = torch.log_softmax(m(full).logits[0].float(), -1)
        rows = lp[len(prompt) - 1 : len(prompt) - 1 + len(sgl_tok)]
        hf_lp = rows.gather(1, torch.tensor(sgl_tok, device="cuda")[:, None])[:, 0].tolist()
        top2 = rows.topk(2, dim=-1).values
        out["min_top2_margin"] = min(out["min_top2_margin"], float((top2[:, 0] - top2[:, 1]).min()))
        diffs = [abs(a - b) for a, b in zip(hf_lp, s.logprobs)]
        out["max_abs_logprob_diff"] = max([out["max_abs_logprob_diff"], *diffs])
        out["hf_tokens"].append(hf_tok)
        out["sgl_tokens"].append(sgl_tok)
        out["match"].append(hf_tok == sgl_tok)
        # where the two greedy paths part, how far SGLang's token is below transformers' best there
        # (in transformers' own log-probs): a gap within bf16 noise is a near-tie, a large one a real error
        k = next((i for i, (a, b) in enumerate(zip(hf_tok, sgl_tok)) if a != b), None)
        if k is None and len(hf_tok) != len(sgl_tok):
            k = min(len(hf_tok), len(sgl_tok))
        gap = None if k is None or k >= len(sgl_tok) else float(rows[k].max() - rows[k, sgl_tok[k]])
        # a near-tie: transformers itself ranks SGLang's token within the two stacks' own disagreement
        # (twice the largest |log-prob| difference seen on the shared prefix, at least TIE_FLOOR nats)
        noise = max([TIE_FLOOR, *(2 * d for d in diffs[: k or 0])])
        out.setdefault("divergence", []).append({"index": k, "hf_logprob_gap": gap, "tie_tolerance": noise})
        out.setdefault("match_up_to_ties", []).append(k is None or (gap is not None and gap <= noise))
        log(f"prompt {len(out['match']) - 1}: match={hf_tok == sgl_tok} diverge_at={k} gap={gap} lp_diffs={diffs}")
    del m
    torch.cuda.empty_cache()
    return out


def sync_times(address: str, tstub, rid: str, transport: str, reps: int) -> tuple[list[dict], list[float]]:
    """The first sync through `wsctl sync`, the repeats through the same Sync RPC (no CLI start-up)."""
    from google.protobuf.json_format import MessageToDict

    from weightsync.v1 import trainer_pb2

    reports = [ws(address, "sync", "--rollout", rid, "--transport", transport, timeout=300)]
    for _ in range(reps - 1):
        req = trainer_pb2.SyncRequest(rollout_ids=[rid], transport=transport, timeout_seconds=120)
        rep = MessageToDict(tstub.Sync(req, timeout=180).report, preserving_proto_field_name=True)
        reports.append(rep)
    bad = [r for r in reports if not r.get("ok")]
    if bad:
        raise RuntimeError(f"sync {transport} -> {rid} failed: {json.dumps(bad[0])[:3000]}")
    return reports, [float(r["seconds"]) for r in reports]


def bytes_per_rank(report: dict) -> list[int]:
    """The SGLang rollout's bytes per TP rank in a sync's report (RolloutSyncResult.bytes_per_rank)."""
    (rollout,) = report.get("rollouts", [{}])
    return [int(b) for b in rollout.get("bytes_per_rank", [])]


def rollout_layout(transports: list[str], gpus: int, tp: int) -> dict:
    """name -> (engine, device) of the rollouts, the trainer on cuda:0. ipc/tcp: s0 (SGLang, its TP ranks on
    GPUs 0..tp-1) and b0 on cuda:0. nccl: s1 and b1 on cuda:1 when there are tp + 1 GPUs (the trainer's GPU
    its own); else s1's ranks share GPUs 0..tp-1 with the trainer (SGLang receives on its last rank's GPU:
    NCCL takes no two ranks on one GPU: `--receive-rank`) and b1 is on cuda:1. An SGLang rollout's entry also
    names its receive rank."""
    rollouts = {"s0": ("sglang", "cuda:0", 0), "b0": ("builtin", "cuda:0")}
    if "nccl" in transports:
        own = gpus >= tp + 1
        s1 = ("sglang", "cuda:1", 0) if own else ("sglang", "cuda:0", tp - 1)
        rollouts.update({"s1": s1, "b1": ("builtin", "cuda:1")})
    return rollouts


def run_transport(rec: dict, t, tstub, stubs, work: Path, prompts, reps: int, load) -> dict:
    """Fills `rec` as it goes (a run cut off by its time limit still records what it measured).
    `load`: None (sync the trainer's weights as they are) or a callable returning an HF directory to
    `wsctl load` first, so this transport's sync must change what SGLang serves."""
    transport = rec["transport"]
    sid, bid = TARGETS[transport]
    rec["sglang_rollout"], rec["builtin_rollout"] = sid, bid
    sgl = stubs[sid]
    if load is not None:
        fresh = load()
        rec["trainer_load"] = ws(t.address, "load", str(fresh), timeout=300)
        rec["trainer_loaded"] = str(fresh)
    # old weights: the second run of the same prompts must reuse the radix cache
    try:
        generate(sgl, prompts)
        before, _ = generate(sgl, prompts)
        rec["prefix_cache_hit_before_sync"] = [s.prefix_cache_hit for s in before]
        rec["tokens_before_sync"] = [list(s.token_ids) for s in before]
    except Exception as exc:  # noqa: BLE001 — e.g. STALE after a failed earlier sync; the sync repairs it
        rec["generate_before_sync_error"] = repr(exc)[:500]
        rec["prefix_cache_hit_before_sync"] = []
    log(f"{transport}: syncing {sid} ({reps} + 1)")
    reports, secs = sync_times(t.address, tstub, sid, transport, reps + 1)
    rec["sync_s_all"] = secs
    rec["sync_s"] = statistics.median(secs[1:])
    rec["first_sync_s"] = secs[0]
    rec["bytes"] = int(reports[0].get("bytes", 0))
    rec["bytes_per_rank"] = bytes_per_rank(reports[-1])
    rec["num_buckets"] = reports[0].get("num_buckets")
    rec["phase_s_first"] = reports[0].get("phase_seconds")
    trainer_version = int(reports[-1]["version"])
    after, served = generate(sgl, prompts)
    rec["prefix_cache_hit_after_sync"] = [s.prefix_cache_hit for s in after]
    st = sgl.GetStatus(rollout_pb2.GetStatusRequest())
    rec["trainer_version"] = trainer_version
    rec["served_version"] = served
    rec["rollouts_on_version"] = st.version == trainer_version == served and st.state == rollout_pb2.SERVING
    # the comparison first: the built-in engine's timings below are the part a time limit may cut
    export_dir = work / f"export-{transport}"
    rec["export"] = ws(t.address, "export", str(export_dir), timeout=300)
    ref = hf_reference(str(export_dir), prompts, after)
    rec["greedy_match"] = all(ref["match"])
    rec["greedy_match_up_to_ties"] = all(ref["match_up_to_ties"])
    rec["min_top2_margin"] = ref["min_top2_margin"]
    rec["max_abs_logprob_diff"] = ref["max_abs_logprob_diff"]
    # the sync changed what SGLang serves (else a stale engine could pass the comparison)
    rec["tokens_changed_by_sync"] = rec.get("tokens_before_sync") != ref["sgl_tokens"]
    hits_before = rec["prefix_cache_hit_before_sync"]
    # flushed: the prompts hit the radix cache before the sync and none did after it
    rec["radix_cache_flushed"] = bool(hits_before) and all(hits_before) and not any(rec["prefix_cache_hit_after_sync"])
    rec["details"] = ref
    flushed = rec["radix_cache_flushed"]
    ties = rec["greedy_match_up_to_ties"]
    log(f"{transport}: greedy_match={rec['greedy_match']} ties_ok={ties} flushed={flushed} sync_s={rec['sync_s']:.3f}")
    log(f"{transport}: syncing {bid} (built-in engine, same machine)")
    _, bsecs = sync_times(t.address, tstub, bid, transport, reps + 1)
    rec["builtin_sync_s_all"] = bsecs
    rec["builtin_sync_s"] = statistics.median(bsecs[1:])
    log(f"{transport}: built-in engine sync_s={rec['builtin_sync_s']:.3f}")
    return rec


def builtin_only(rec: dict, fleet, reps: int) -> None:
    """After a failed run, the built-in rollout's syncs over the same transport, if not timed yet: tells
    an SGLang-side failure from one of the host or the trainer."""
    if "builtin_sync_s" in rec:
        return
    try:
        _, bsecs = sync_times(
            fleet.trainer.address, fleet.tstub, TARGETS[rec["transport"]][1], rec["transport"], reps + 1
        )
        rec["builtin_sync_s_all"] = bsecs
        rec["builtin_sync_s"] = statistics.median(bsecs[1:])
    except Exception as exc:  # noqa: BLE001 — recorded
        rec["builtin_error"] = repr(exc)[:3000]


class Fleet:
    """A megatron trainer on cuda:0 and rollouts (name -> (engine, device[, receive rank])), all serving
    `start_dir`."""

    def __init__(self):
        self.procs, self.chans, self.stubs = [], [], {}
        self.trainer = self.tstub = None

    def start(
        self,
        work: Path,
        init_model: Path,
        start_dir: Path,
        rollouts: dict,
        ready_timeout: float,
        inflight: int = 0,
        tp_size: int = 1,
        export_dtype: str = "bfloat16",
        sglang_dir: Path | None = None,
    ) -> None:
        """Assign the Fleet before calling this: if a service fails to start, stop() still reaches the others.
        `inflight`: Generate calls one client may have in flight (the rollouts' default is 4; --concurrency
        sends its N from one client). `tp_size`: SGLang's, its ranks on the GPUs from each SGLang rollout's
        device on. `export_dtype`: the trainer's; `sglang_dir`: what the SGLang rollouts serve instead of
        `start_dir` (a block-FP8 checkpoint for fp8-block syncs: save_random_fp8)."""
        t = start_trainer(
            work, "--backend", "megatron", "--model", str(init_model), "--init-seed", "1", "--param-dtype", "bfloat16",
            "--transport", "ipc", "--export-dtype", export_dtype, "--no-auto-sync-new-rollouts",
        )  # fmt: skip
        self.procs.append(t)
        self.trainer = t
        for name, (engine, device, *receive) in rollouts.items():
            serves = sglang_dir if engine == "sglang" and sglang_dir else start_dir
            args = ["--engine", engine, "--model", str(serves), "--device", device, "--dtype", "bfloat16"]
            args += ["--apply-mode", "inplace", "--serve-initial-weights", "--trainer-address", t.address]
            args += ["--register-timeout-s", str(ready_timeout)]
            if inflight > 4:
                args += ["--max-inflight-requests", str(max(16, inflight)), "--max-inflight-per-client", str(inflight)]
            if engine == "sglang":
                args += [a for k, v in SGLANG_ARGS.items() for a in ("--sglang-arg", f"{k}={v}")]
                args += ["--tp", str(tp_size), "--receive-rank", str(receive[0] if receive else 0)]
                if tp_size > 1:  # its custom all-reduce is sgl_kernel's (absent: the shim); NCCL's instead
                    args += ["--sglang-arg", "disable_custom_all_reduce=true"]
            self.procs.append(start_rollout(work, *args, name=name))
        deadline = time.monotonic() + ready_timeout
        for p in self.procs:
            p.wait_ready(timeout=max(1.0, deadline - time.monotonic()))
            log(f"{p.name} ready")
        wait_registered(t.address, list(rollouts), max(1.0, deadline - time.monotonic()))
        for p in self.procs[1:]:
            ch = channel(p.address)
            self.chans.append(ch)
            self.stubs[p.name] = rollout_stub(ch, "", 120)
        tch = channel(t.address)
        self.chans.append(tch)
        self.tstub = trainer_stub(tch, "", 180)

    def stop(self, res: dict, tag: str = "") -> None:
        for ch in self.chans:
            ch.close()
        for p in self.procs:
            res.setdefault("logs_tail", {})[tag + p.name] = p.log()[-2500:]
            logs = Path(os.environ.get("OUT", "/tmp")) / "logs"  # sglang_live.sh tars them (8 files come back)
            logs.mkdir(exist_ok=True)
            (logs / f"{tag}{p.name}.log").write_text(p.log())
            p.stop()
            try:
                os.killpg(p.popen.pid, signal.SIGKILL)  # SGLang's scheduler children too
            except (ProcessLookupError, PermissionError):
                pass


def concurrency_run(res: dict, stubs: dict, prompts, clients: int, tokens: int) -> None:
    """`clients` one-prompt greedy Generate calls at once vs one after another, per engine (s0, b0)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(stub, k: int):
        req = rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(token_ids=prompts[k % len(prompts)])],
            sampling=rollout_pb2.SamplingParams(max_new_tokens=tokens, temperature=0.0, n=1),
        )
        return [list(x.token_ids) for x in stub.Generate(req, timeout=600).samples]

    for rid in ("s0", "b0"):
        rec = {"rollout": rid, "engine": "sglang" if rid.startswith("s") else "builtin", "clients": clients}
        res.setdefault("concurrency_runs", []).append(rec)
        try:
            stub = stubs[rid]
            one(stub, 0)  # warm-up
            t0 = time.perf_counter()
            seq = [one(stub, k) for k in range(clients)]
            rec["sequential_s"] = time.perf_counter() - t0
            with ThreadPoolExecutor(clients) as pool:
                t0 = time.perf_counter()
                conc = list(pool.map(functools.partial(one, stub), range(clients)))
                rec["concurrent_s"] = time.perf_counter() - t0
            n_tok = sum(len(ids) for out in seq for ids in out)
            rec["tokens"] = n_tok
            rec["sequential_tokens_per_s"] = n_tok / rec["sequential_s"]
            rec["concurrent_tokens_per_s"] = sum(len(i) for out in conc for i in out) / rec["concurrent_s"]
            rec["speedup"] = rec["sequential_s"] / rec["concurrent_s"]
            rec["same_tokens"] = conc == seq
            log(f"concurrency {rid}: {clients} clients x {tokens} tokens: {rec['speedup']:.2f}x sequential")
        except Exception as exc:  # noqa: BLE001 — recorded
            traceback.print_exc()
            rec["error"] = repr(exc)[:3000]


def direct_lines(fleet, name: str) -> list[str]:
    """How rollout `name`'s buckets were written in SGLang's workers (rollout_svc/engine/sglang_direct.py logs
    each change: learning the slot table, then the table, or SGLang's loader where it has none)."""
    for p in fleet.procs:
        if p.name == name:
            lines = p.log().splitlines()
            marks = ("written in SGLang's workers", "slot tables exported", "will not write into SGLang")
            how = [ln[-160:] for ln in lines if any(m in ln for m in marks)][-12:]
            return how + [ln[-400:] for ln in lines if "sglang apply timings" in ln][-8:]
    return []


def print_timing(res: dict) -> None:
    for r in res.get("timing_runs", []):
        keys = ("model", "transport", "export_dtype", "tp_size", "sync_s", "builtin_sync_s", "bytes", "bytes_per_rank")
        keys += ("route", "builtin_route")
        print({k: r.get(k) for k in (*keys, "error", "direct_how")}, flush=True)


def timing_run(
    res: dict,
    model: str,
    work: Path,
    reps: int,
    ready_timeout: float,
    tp: int = 1,
    transports=("ipc",),
    gpus: int = 1,
    export_dtype: str = "bfloat16",
) -> None:
    """Sync time into SGLang and the built-in engine at `model`'s shape (random weights), per transport: ipc
    colocated on cuda:0; nccl with the rollouts where rollout_layout puts them. One fleet per transport, so two
    SGLang engines never share a GPU's memory. `export_dtype` fp8-block: the trainer sends block FP8, SGLang
    serves a block-FP8 checkpoint of the same weights (takes the pairs as they are), the built-in engine the
    16-bit one (dequantizes)."""
    for transport in transports:
        rollouts = {k: v for k, v in rollout_layout([transport], gpus, tp).items() if k in TARGETS[transport]}
        timing_one(res, model, work, reps, ready_timeout, tp, transport, rollouts, export_dtype)


def timing_one(
    res: dict,
    model: str,
    work: Path,
    reps: int,
    ready_timeout: float,
    tp: int,
    transport: str,
    rollouts,
    export_dtype: str = "bfloat16",
):
    sid, bid = TARGETS[transport]
    rec = {"model": model, "transport": transport, "tp_size": tp, "trainer_backend": "megatron", "weights": "random"}
    rec["rollouts"], rec["export_dtype"] = rollouts, export_dtype
    res.setdefault("timing_runs", []).append(rec)
    fleet = None
    try:
        cfg_dir = write_config(model, work)
        start_dir = save_random_hf(cfg_dir, work / f"start-{model}", seed=2)
        sglang_dir = save_random_fp8(start_dir, work / f"start-{model}-fp8") if export_dtype == "fp8-block" else None
        fleet = Fleet()
        fleet.start(
            work,
            cfg_dir,
            start_dir,
            rollouts,
            ready_timeout,
            tp_size=tp,
            export_dtype=export_dtype,
            sglang_dir=sglang_dir,
        )
        for rid, key in ((sid, "sync_s"), (bid, "builtin_sync_s")):
            log(f"timing {model}: syncing {rid} over {transport} ({reps} + 1)")
            reports, secs = sync_times(fleet.trainer.address, fleet.tstub, rid, transport, reps + 1)
            rec[key + "_all"] = secs
            rec[key] = statistics.median(secs[1:])
            rec.setdefault("bytes", int(reports[0].get("bytes", 0)))
            rec.setdefault("num_buckets", reports[0].get("num_buckets"))
            rec[key.replace("sync_s", "phase_s_last")] = reports[-1].get("phase_seconds")
            # route / builtin_route: what the timed syncs took (SGLang: ipc/trainer_writes/... from its second on)
            rec[key.replace("sync_s", "route")] = reports[-1].get("route")
            rec[key.replace("sync_s", "routes_all")] = [r.get("route") for r in reports]
            if rid == sid:
                rec["bytes_per_rank"] = bytes_per_rank(reports[-1])
            log(f"timing {model}: {rid} sync_s={rec[key]:.3f}")
        # where SGLang's sync spends more than the built-in engine's, per trainer phase (the last sync of each)
        mine, theirs = rec.get("phase_s_last") or {}, rec.get("builtin_phase_s_last") or {}
        rec["phase_s_over_builtin"] = {k: mine[k] - theirs.get(k, 0.0) for k in sorted(mine)}
        st = fleet.stubs[sid].GetStatus(rollout_pb2.GetStatusRequest())
        rec["rollouts_on_version"] = st.version == int(reports[-1]["version"])
        rec["direct_how"] = direct_lines(fleet, sid)
    except Exception as exc:  # noqa: BLE001 — recorded
        traceback.print_exc()
        rec["error"] = repr(exc)[:3000]
    finally:
        if fleet is not None:
            fleet.stop(res, tag=f"{model}-{transport}-")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="0.5b", help="shape of the random weights when --peaked is not given")
    ap.add_argument("--peaked", default="", help="bench/peaked_model.py's output dir (checkpoints a and b)")
    ap.add_argument("--transports", default="", help="default: ipc,tcp, and nccl when 2 GPUs are visible")
    ap.add_argument("--reps", type=int, default=5, help="timed syncs per transport and engine, after one warm-up")
    ap.add_argument("--timing-model", default="", help="then time ipc syncs at this shape (e.g. 1.5b), random weights")
    ap.add_argument("--out", required=True)
    ap.add_argument("--ready-timeout", type=float, default=240)
    ap.add_argument("--concurrency", type=int, default=0, help="N concurrent one-prompt requests vs sequential")
    ap.add_argument("--concurrency-tokens", type=int, default=64, help="new tokens per concurrent request")
    ap.add_argument("--colocated-rl", action="store_true", help="only the colocated RL run (bench/sglang_rl.py)")
    ap.add_argument("--rl-steps", type=int, default=14, help="colocated RL steps with SGLang's memory released")
    ap.add_argument("--rl-held-steps", type=int, default=4, help="then steps with it held, for the comparison")
    ap.add_argument("--timing-transports", default="ipc", help="transports of the --timing-model runs (ipc,nccl)")
    ap.add_argument("--timing-only", action="store_true", help="only the --timing-model runs (no greedy runs)")
    ap.add_argument("--tp-size", type=int, default=1, help="SGLang's tp_size (its ranks on GPUs 0..N-1; nccl: below)")
    ap.add_argument(
        "--timing-dtype",
        default="bfloat16",
        choices=("bfloat16", "fp8-block"),
        help="the trainer's export dtype in the --timing-model runs; fp8-block: SGLang serves a block-FP8 checkpoint",
    )
    args = ap.parse_args()
    # `timeout` sends SIGTERM: unwind through `finally` so the services are stopped and the JSON written
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"terminated (SIGTERM) at {time.strftime('%H:%M:%S')}"))
    import sglang.version

    gpus = torch.cuda.device_count()
    transports = args.transports.split(",") if args.transports else ["ipc", "tcp"] + (["nccl"] if gpus >= 2 else [])
    if "nccl" in transports and gpus < 2:
        raise SystemExit("transport nccl needs 2 visible GPUs (trainer on cuda:0, rollouts on cuda:1)")
    if args.tp_size > gpus:
        raise SystemExit(f"--tp-size {args.tp_size} needs as many visible GPUs ({gpus} here)")
    if args.tp_size > 1:
        # the trainer sits on cuda:0 only: SGLang's ranks see unequal free memory there by design
        os.environ.setdefault("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK", "false")
    peaked = Path(args.peaked) if args.peaked else None
    prompts = peaked_model.PROMPTS if peaked else RANDOM_PROMPTS
    res: dict = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "device": torch.cuda.get_device_name(0),
        "gpus": gpus,
        "engine_version": sglang.version.__version__,
        "torch": torch.__version__,
        "model": f"peaked ({peaked_model.SHAPE}, vocab {peaked_model.VOCAB})" if peaked else args.model,
        "weights": "trained (bench/peaked_model.py)" if peaked else "random",
        "prompts": prompts,
        "max_new_tokens": N_NEW,
        "sglang_args": SGLANG_ARGS,
        "tp_size": args.tp_size,
        "runs": [],
    }
    if peaked:
        res["peaked_report"] = json.loads((peaked / "peaked_report.json").read_text())
    work = Path(tempfile.mkdtemp(prefix="ws-sglang-live-"))
    if args.colocated_rl:  # alone: it fits one device call (bench/sglang_rl.py)
        from bench.sglang_rl import colocated_rl

        def save():
            Path(args.out).write_text(json.dumps(res, indent=2))

        colocated_rl(res, work, save, args.rl_steps, args.rl_held_steps, args.ready_timeout)
        rl = res["colocated_rl"]
        print({k: rl.get(k) for k in ("first_reward", "last_reward", "syncs_exact", "peak_gib_released")}, flush=True)
        print({k: rl.get(k) for k in ("peak_gib_held", "greedy_match", "greedy_match_up_to_ties", "error")}, flush=True)
        return 0 if rl.get("syncs_exact") and "error" not in rl else 1
    timing_transports = args.timing_transports.split(",")
    if "nccl" in timing_transports and gpus < 2:
        raise SystemExit("--timing-transports nccl needs 2 visible GPUs")
    if args.timing_only:
        if not args.timing_model:
            raise SystemExit("--timing-only needs --timing-model")
        timing_run(
            res, args.timing_model, work, args.reps, args.ready_timeout, args.tp_size, timing_transports, gpus,
            args.timing_dtype,
        )  # fmt: skip
        Path(args.out).write_text(json.dumps(res, indent=2))
        print_timing(res)
        return 0 if all(r.get("error") is None for r in res["timing_runs"]) else 1
    fleet = None
    try:
        if peaked:
            init_model = peaked / "a"
        else:
            init_model = write_config(args.model, work)
        start_dir = save_random_hf(init_model, work / "start", seed=2)  # what every rollout serves at start
        rollouts = rollout_layout(transports, gpus, args.tp_size)
        res["rollouts"] = rollouts
        fleet = Fleet()
        fleet.start(
            work, init_model, start_dir, rollouts, args.ready_timeout, inflight=args.concurrency, tp_size=args.tp_size
        )
        for i, tr in enumerate(transports):
            Path(args.out).write_text(json.dumps(res, indent=2))  # what is known so far, if cut off
            rec = {"transport": tr, "trainer_backend": "megatron", "tp_size": args.tp_size}
            res["runs"].append(rec)
            if i == 0:
                load = None  # the trainer's initial weights
            elif peaked:
                load = functools.partial(copy_under, peaked / ("b" if i % 2 else "a"), work / f"load-{tr}")
            else:
                load = functools.partial(save_random_hf, init_model, work / f"load-{tr}", 10 + i)
            try:
                run_transport(rec, fleet.trainer, fleet.tstub, fleet.stubs, work, prompts, args.reps, load)
                rec["direct_how"] = direct_lines(fleet, TARGETS[tr][0])
            except Exception as exc:  # noqa: BLE001 — recorded; the next transport still runs
                traceback.print_exc()
                rec["error"] = repr(exc)[:3000]
                builtin_only(rec, fleet, args.reps)
        if args.concurrency:
            Path(args.out).write_text(json.dumps(res, indent=2))
            concurrency_run(res, fleet.stubs, prompts, args.concurrency, args.concurrency_tokens)
        from tests.support import sgl_kernel_shim

        res["shim_routes"] = {m: r[0] for m, r in sgl_kernel_shim.ROUTES.items()}
        res["shim_stubbed"] = sorted(sgl_kernel_shim.STUBBED)
        fleet.stop(res)
        fleet = None
        if args.timing_model:
            Path(args.out).write_text(json.dumps(res, indent=2))
            timing_run(
                res, args.timing_model, work, args.reps, args.ready_timeout, args.tp_size, timing_transports, gpus,
                args.timing_dtype,
            )  # fmt: skip
    except BaseException as exc:  # noqa: BLE001 — SystemExit from SIGTERM too: record, then clean up
        traceback.print_exc()
        res["error"] = repr(exc)[:3000]
    finally:
        if fleet is not None:
            fleet.stop(res)
    Path(args.out).write_text(json.dumps(res, indent=2))
    keys = ("transport", "tp_size", "greedy_match", "greedy_match_up_to_ties", "max_abs_logprob_diff", "sync_s")
    keys += ("builtin_sync_s", "bytes", "bytes_per_rank")
    for r in res["runs"]:
        print({k: r.get(k) for k in (*keys, "rollouts_on_version", "radix_cache_flushed", "error")})
    for r in res.get("concurrency_runs", []):
        keys_c = ("rollout", "clients", "speedup", "concurrent_tokens_per_s", "same_tokens", "error")
        print({k: r.get(k) for k in keys_c})
    print_timing(res)
    ok = res["runs"] and all(r.get("greedy_match") for r in res["runs"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
