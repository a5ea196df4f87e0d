"""The token check of bench/sglang_live.py: per transport, sync the SGLang rollout (several buckets: the
trainer's `--bucket-mb`), then its greedy tokens against transformers' on the trainer's exported weights,
the radix cache flushed, the served version the trainer's; then the built-in rollout's syncs beside it."""

from __future__ import annotations

import functools
import json
import statistics
import traceback
from pathlib import Path

import torch

from bench.sglang_fleet import TARGETS, copy_under, direct_lines, log, save_random_hf, sync_times, ws
from bench.sglang_fleet import bytes_per_rank as rank_bytes
from weightsync.v1 import rollout_pb2

#: prompts for random weights (Qwen2.5 vocabulary); the peaked model brings its own (peaked_model.PROMPTS)
RANDOM_PROMPTS = [[9707, 11, 847, 829, 374, 1207, 16948, 13], [785, 6722, 315, 9625, 374], [16, 11, 17, 11, 18, 11, 19]]
N_NEW = 12
#: nats: below this, a greedy step is a tie between bf16 kernel stacks, not evidence of wrong weights
TIE_FLOOR = 0.05


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


def _generate_old(rec: dict, sgl, prompts) -> None:
    """Old weights, twice: the second run of the same prompts must reuse the radix cache."""
    try:
        generate(sgl, prompts)
        before, _ = generate(sgl, prompts)
        rec["prefix_cache_hit_before_sync"] = [s.prefix_cache_hit for s in before]
        rec["tokens_before_sync"] = [list(s.token_ids) for s in before]
    except Exception as exc:  # noqa: BLE001 — e.g. STALE after a failed earlier sync; the sync repairs it
        rec["generate_before_sync_error"] = repr(exc)[:500]
        rec["prefix_cache_hit_before_sync"] = []


def _compare(rec: dict, ref: dict) -> None:
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
    _generate_old(rec, sgl, prompts)
    log(f"{transport}: syncing {sid} ({reps} + 1)")
    reports, secs = sync_times(t.address, tstub, sid, transport, reps + 1)
    rec["sync_s_all"] = secs
    rec["sync_s"] = statistics.median(secs[1:])
    rec["first_sync_s"] = secs[0]
    rec["bytes"] = int(reports[0].get("bytes", 0))
    rec["bytes_per_rank"] = rank_bytes(reports[-1])
    rec["num_buckets"] = reports[0].get("num_buckets")
    rec["route"] = reports[-1].get("route")
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
    _compare(rec, hf_reference(str(export_dir), prompts, after))
    flushed, ties, nb = rec["radix_cache_flushed"], rec["greedy_match_up_to_ties"], rec["num_buckets"]
    log(f"{transport}: greedy_match={rec['greedy_match']} ties_ok={ties} flushed={flushed} buckets={nb}")
    log(f"{transport}: sync_s={rec['sync_s']:.4f}; syncing {bid} (built-in engine, same machine)")
    _, bsecs = sync_times(t.address, tstub, bid, transport, reps + 1)
    rec["builtin_sync_s_all"] = bsecs
    rec["builtin_sync_s"] = statistics.median(bsecs[1:])
    log(f"{transport}: built-in engine sync_s={rec['builtin_sync_s']:.4f}")
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


def greedy_runs(res: dict, fleet, work: Path, transports: list[str], prompts, init_model: Path, args, save) -> None:
    """One `runs[]` entry per transport, each syncing different weights than the one before (peaked `a`/`b`
    alternately, or fresh random ones); `save()` writes what is known so far, if the run is cut off."""
    for i, tr in enumerate(transports):
        save()
        rec = {"transport": tr, "trainer_backend": "megatron", "tp_size": args.tp_size, "bucket_mb": args.bucket_mb}
        res["runs"].append(rec)
        if i == 0:
            load = None  # the trainer's initial weights
        elif args.peaked:
            peaked = Path(args.peaked)
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


def print_runs(res: dict) -> None:
    keys = ("transport", "tp_size", "num_buckets", "greedy_match", "greedy_match_up_to_ties", "max_abs_logprob_diff")
    keys += ("sync_s", "builtin_sync_s", "bytes", "bytes_per_rank", "rollouts_on_version", "radix_cache_flushed")
    for r in res["runs"]:
        print(json.dumps({k: r.get(k) for k in (*keys, "error")}), flush=True)
