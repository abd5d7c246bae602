"""`make bench` part "memory": the activation memory of training `base` under bf16, read on
the CPU (train.model.memory: the arrays the gradient keeps, traced, nothing computed).

Bytes per token per layer, the T x T scores of the XLA attention left out (the fused cuDNN
kernel keeps none; its float32 softmax statistics, 40 bytes per segment-table slot, come on
top on a GPU: tests/test_memory.py). Beside it, the reference: Korthikanti et al. 2022's
34 * d_model bytes for a 16-bit layer with dropout masks, which this model has none of.
DESIGN.md section 9 sets the limit at 22 KB.
"""

from __future__ import annotations


def run() -> dict[str, float]:
    from train.model import arch, memory

    cfg = arch.MODELS["base"]
    got = memory.per_token_layer(cfg)
    per_row = got["bytes"] * cfg.seq_len * cfg.n_layers
    return {
        "memory.base_bytes_per_token_layer": got["bytes"],
        "memory.base_mib_per_row": per_row / 2**20,
        "memory.base_mlp_width_bytes_per_token_layer": got["by_kind"][f"bfloat16[{cfg.d_mlp}]"],
        "memory.korthikanti_bytes_per_token_layer": 34.0 * cfg.d_model,
        "memory.base_vs_korthikanti": got["bytes"] / (34.0 * cfg.d_model),
    }
