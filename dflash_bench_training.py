"""A drafter training step without DeepSpeed or data, as the benchmarks run it: random full-length
rows (`make_batch`) and AdamW on fp32 master weights (`MasterWeightAdamW`, DeepSpeed's bf16 scheme
on one rank, unsharded). bench_dflash.py times its steps with them, and
tools/gpu/drafter_rank_memory.py measures a drafter rank's memory.
"""

import torch

from dflash_model import DFlashConfig


def make_batch(batch: int, seq_len: int, config: DFlashConfig, device, dtype, with_features: bool = True, with_target_hidden: bool = False):
    """Random full-length rows: input_ids [batch, S], loss_mask [batch, S] (prompt = first S/8), features
    [batch, S, 5*hidden], and the target's last hidden state [batch, S, hidden] for the distribution losses (else None)."""
    input_ids = torch.randint(0, config.mask_token_id, (batch, seq_len), device=device)
    loss_mask = torch.zeros(batch, seq_len, dtype=torch.bool, device=device)
    loss_mask[:, seq_len // 8 :] = True
    features = target_hidden = None
    if with_features:
        features = torch.randn(batch, seq_len, len(config.target_layer_ids) * config.hidden_size, device=device, dtype=dtype)
    if with_target_hidden:
        target_hidden = torch.randn(batch, seq_len, config.hidden_size, device=device, dtype=dtype)
    return input_ids, loss_mask, features, target_hidden


# ----------------------------------------------------------------------------------------------
# Optimizer: DeepSpeed's bf16 scheme without sharding


class MasterWeightAdamW:
    """AdamW on fp32 master copies of low-precision params, with grad clipping (the paper's recipe: bf16 params, fp32 master weights).

    fp32 params (CPU) are stepped directly. State per trainable param: fp32 master + fp32 grad +
    2 fp32 Adam moments = 16 bytes, which ZeRO-2 shards over the drafter ranks.
    """

    def __init__(self, params, lr: float, max_grad_norm: float, fused: bool):
        self.params = [p for p in params if p.requires_grad]
        self.has_master = any(p.dtype != torch.float32 for p in self.params)
        self.master = [p.detach().float() for p in self.params] if self.has_master else self.params
        if self.has_master:
            for m in self.master:
                m.grad = torch.zeros_like(m)
        self.max_grad_norm = max_grad_norm
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, weight_decay=0.0, fused=fused)

    @torch.no_grad()
    def step(self) -> None:
        if self.has_master:
            torch._foreach_copy_([m.grad for m in self.master], [p.grad for p in self.params])
        torch.nn.utils.clip_grad_norm_(self.master, self.max_grad_norm, foreach=True)
        self.optimizer.step()
        if self.has_master:
            torch._foreach_copy_(self.params, self.master)
        self.zero_grad()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
