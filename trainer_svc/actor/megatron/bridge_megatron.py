"""Megatron-Bridge (NVIDIA-NeMo, pinned 0.6.2) as a converter: `AutoBridge.from_hf_config` →
`export_hf_weights(chunks)` / `load_hf_weights(chunks, dir)`.

UNVERIFIED here: megatron-bridge 0.6.2 needs Python 3.12 and a newer megatron-core than the 0.16
this project pins (its `megatron.bridge` import fails on 0.16.1), and no release fits
transformers 5.23. What is checked is the API contract (bridge_contract.py) and, at start-up,
the generic plan check in bridge.py (same tensors and shapes as transformers). From reading 0.6.2:
its registry aliases the local spec's separate norm modules itself, it exports a padded vocabulary
untrimmed (bridge.py trims it), and for a tied model built from a config it also yields
`lm_head.weight` (bridge.py drops it).
"""

from __future__ import annotations

from trainer_svc.bridge_contract import BridgeUnavailable


class MegatronBridgeAdapter:
    def __init__(self, megatron_bridge, hf_config):
        auto = megatron_bridge.AutoBridge
        if not auto.supports(hf_config):
            raise BridgeUnavailable(
                f"converter='megatron-bridge': megatron-bridge has no bridge for model_type="
                f"{hf_config.model_type!r}; use converter=builtin"
            )
        self.bridge = auto.from_hf_config(hf_config)

    def export(self, chunks):
        # cpu=False: tensors stay where the model is; the bus moves them (or copies to host for TCP)
        return self.bridge.export_hf_weights(chunks, cpu=False, show_progress=False)

    def load(self, chunks, path: str) -> None:
        self.bridge.load_hf_weights(chunks, hf_path=path)
