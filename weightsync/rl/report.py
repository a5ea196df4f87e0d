"""Human output of the loop: the per-step table and a PNG of reward and sync time per step."""

from __future__ import annotations

from pathlib import Path

HEADER = (
    f"{'step':>4} {'reward':>7} {'gen_v':>5} {'train_v':>7} {'synced_v':>8} {'sync_s':>7} "
    f"{'mismatch':>9} {'loss':>8} {'entropy':>7} {'grad':>6} {'gen_s':>6} {'train_s':>7}"
)


def row(r) -> str:
    synced = str(r.synced_version) if r.synced_version else "-"
    return (
        f"{r.step:>4} {r.reward_mean:>7.3f} {r.rollout_version:>5} {r.trainer_version:>7} {synced:>8} "
        f"{r.sync_seconds:>7.3f} {r.mismatch_max:>9.2e} {r.loss:>8.4f} {r.entropy:>7.3f} {r.grad_norm:>6.3f} "
        f"{r.generate_seconds:>6.2f} {r.train_seconds:>7.2f}"
    )


def plot(records, path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    a.plot(steps, [r.reward_mean for r in records], marker="o", ms=3)
    a.set_ylabel("mean reward")
    a.set_ylim(0, 1.02)
    a.grid(alpha=0.3)
    if title:
        a.set_title(title)
    b.plot(steps, [r.sync_seconds * 1e3 for r in records], marker="o", ms=3, color="tab:orange")
    b.set_ylabel("sync time (ms)")
    b.set_ylim(bottom=0)
    b.set_xlabel("trainer step")
    b.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
