"""A small Qwen2-shaped model with decisive next-token margins, for live greedy comparisons (issue 34).

Random weights put the top two logits of a greedy step within bf16 noise of each other (margins of
0.004 nats at the 0.5B shape), so two correct bf16 kernel stacks (SGLang's, transformers') pick
different tokens and a strict token comparison cannot tell a wrong weight from a tie. This trains a
tiny Qwen2ForCausalLM on a fixed corpus until it has memorised it: each fixed prompt (PROMPTS) is
the start of one training sequence, so greedy decoding from it follows the memorised continuation
with margins of several nats at every step.

Two checkpoints from different corpora (same prompts, other continuations): `a` is the trainer's
initial weights, `b` is what `wsctl load` swaps in, so a sync visibly changes the tokens served.

    python bench/peaked_model.py --out DIR            # writes DIR/a and DIR/b (about 6 MB each, bf16)

Deterministic (fixed seeds, one thread) so that a rerun writes the same weights; about a minute of CPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

#: the fixed prompts the live run generates from (token ids < VOCAB)
PROMPTS = [[970, 11, 847, 829, 374, 1207, 1694, 13], [785, 672, 315, 962, 374], [16, 11, 17, 11, 18, 11, 19]]
#: memorised tokens after each prompt; the live run generates fewer (bench/sglang_live.py N_NEW)
CONTINUATION = 20
VOCAB = 2048
#: never in the corpus, so neither engine stops early on it
EOS = VOCAB - 1
#: (hidden, intermediate, layers, heads, kv heads): head_dim 64 like Qwen2.5, GQA 2:1
SHAPE = (256, 768, 2, 4, 2)
#: extra random sequences besides the prompts' own, so the weights are not only those three paths
FILLER = 29
SEQ_LEN = 32


def config():
    from transformers import Qwen2Config

    h, inter, layers, heads, kv = SHAPE
    return Qwen2Config(
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=VOCAB,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        bos_token_id=EOS,
        eos_token_id=EOS,
    )


def corpus(seed: int) -> torch.Tensor:
    """PROMPTS each followed by a random continuation, then FILLER random sequences; [n, SEQ_LEN]."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for p in PROMPTS:
        cont = torch.randint(0, EOS, (SEQ_LEN - len(p),), generator=g).tolist()
        rows.append(p + cont)
    for _ in range(FILLER):
        rows.append(torch.randint(0, EOS, (SEQ_LEN,), generator=g).tolist())
    return torch.tensor(rows)


def train(seed: int, steps: int, log_every: int = 50):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1000 + seed)
    m = AutoModelForCausalLM.from_config(config(), dtype=torch.float32)
    data = corpus(seed)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    m.train()
    loss = None
    for step in range(steps):
        out = m(input_ids=data, labels=data)
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        sched.step()
        loss = out.loss.item()
        if step % log_every == 0:
            print(f"seed {seed} step {step} loss {loss:.4f}", flush=True)
    m.eval()
    return m, loss, data


@torch.no_grad()
def greedy_margins(m, n_new: int) -> dict:
    """Greedy from each prompt in bf16: the tokens, and the smallest top-1 minus top-2 log-prob on the path."""
    mb = m.to(torch.bfloat16)
    toks, margins = [], []
    for p in PROMPTS:
        ids = list(p)
        path_margin = float("inf")
        for _ in range(n_new):
            lp = torch.log_softmax(mb(torch.tensor([ids])).logits[0, -1].float(), -1)
            top2 = lp.topk(2).values
            path_margin = min(path_margin, float(top2[0] - top2[1]))
            ids.append(int(lp.argmax()))
        toks.append(ids[len(p) :])
        margins.append(path_margin)
    return {"tokens": toks, "min_margin_per_prompt": margins}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--check-new", type=int, default=12, help="greedy steps whose margins are checked")
    ap.add_argument("--min-margin", type=float, default=1.0, help="nats; fail below this on any greedy step")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    report = {}
    for name, seed in (("a", 1), ("b", 2)):
        t0 = time.monotonic()
        m, loss, data = train(seed, args.steps)
        check = greedy_margins(m, args.check_new)
        expected = [row[len(p) : len(p) + args.check_new].tolist() for p, row in zip(PROMPTS, data)]
        check["memorised"] = check["tokens"] == expected
        check["final_loss"] = loss
        check["train_s"] = round(time.monotonic() - t0, 1)
        m.to(torch.bfloat16).save_pretrained(out / name)
        report[name] = check
        print(name, json.dumps(check), flush=True)
        if not check["memorised"] or min(check["min_margin_per_prompt"]) < args.min_margin:
            print(f"{name}: greedy path not decisive (need every margin >= {args.min_margin} nats)")
            return 1
    if report["a"]["tokens"] == report["b"]["tokens"]:
        print("a and b continue the prompts identically: a sync from one to the other would not show")
        return 1
    (out / "peaked_report.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
