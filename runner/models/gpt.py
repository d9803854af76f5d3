"""A decoder-only transformer language model, small and readable, in the style of nanoGPT's ``model.py``.

Architecture: GPT-2 (Radford et al. 2019): the Transformer decoder (https://arxiv.org/abs/1706.03762), pre-LayerNorm,
learned positions, GELU, tied embedding (Press & Wolf 2017). Names and initialization follow nanoGPT
(https://github.com/karpathy/nanoGPT/blob/master/model.py), so its parameter names carry over.

Attention is ``F.scaled_dot_product_attention(..., is_causal=True)``, the fastest kernel the device, dtype and shapes
allow, without a ``(T, T)`` mask: https://pytorch.org/docs/stable/generated/torch.nn.functional.scaled_dot_product_attention.html
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``(B, T, n_embd)`` -> ``(B, T, n_embd)``.

    Head size ``n_embd // n_head``; ``upcast_attention``: softmax(QK^T)V in fp32 when Q, K, V are bf16/fp16
    (why: docs/language-models.md).
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool, upcast_attention: bool = False):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be a multiple of n_head={n_head}")
        self.n_head = n_head
        self.dropout = dropout
        self.upcast_attention = upcast_attention
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # (B, heads, T, head size); under tensor parallelism c_attn gives this rank's heads only: their count is -1
        q, k, v = (z.view(b, t, -1, c // self.n_head).transpose(1, 2) for z in self.c_attn(x).chunk(3, dim=2))
        p = self.dropout if self.training else 0.0
        if self.upcast_attention and q.dtype != torch.float32:  # back to q's dtype for c_proj's bf16 weights
            with torch.autocast(q.device.type, enabled=False):
                y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), dropout_p=p, is_causal=True).to(
                    q.dtype
                )
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, t, -1)))


class MLP(nn.Module):
    """Position-wise feed-forward: Linear(n_embd, 4 n_embd) -> GELU -> Linear(4 n_embd, n_embd) -> dropout."""

    def __init__(self, n_embd: int, dropout: float, bias: bool):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``; shape-preserving."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool, upcast_attention: bool = False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias, upcast_attention)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT language model: token ids ``(B, T)`` int64 -> next-token logits ``(B, T, vocab_size)``, T <= block_size.

    nanoGPT's ``GPT`` (https://github.com/karpathy/nanoGPT/blob/master/model.py) without its optimizer helpers.

    Args:
        vocab_size: number of token ids (from the data: ``data=text`` passes its character count).
        block_size: the longest context (positions with a learned embedding).
        n_layer, n_head, n_embd: depth, attention heads per block, width (``n_embd % n_head == 0``).
        dropout: on embeddings, attention weights, residual branches (0 = off; training mode only).
        bias: biases in the Linear and LayerNorm layers (nanoGPT: False is slightly better and faster).
        upcast_attention: attention in fp32 under bf16/fp16 autocast (``CausalSelfAttention``).

    Initialization (nanoGPT): weights ~ N(0, 0.02), biases zero, ``c_proj`` ~ N(0, 0.02 / sqrt(2 n_layer)).
    ``tp_plan``: how ``distributed=tp`` splits it (Megatron-LM's attention and MLP pairs; runner/techniques/
    model_parallel.py); the embeddings, LayerNorms and the tied head stay whole on every rank.
    """

    tp_plan = {
        "transformer.h.*.attn.c_attn": "colwise_qkv",
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
    }

    def __init__(
        self,
        vocab_size: int,
        block_size: int = 256,
        n_layer: int = 6,
        n_head: int = 6,
        n_embd: int = 384,
        dropout: float = 0.0,
        bias: bool = False,
        upcast_attention: bool = False,
    ):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab_size, n_embd),
                wpe=nn.Embedding(block_size, n_embd),
                drop=nn.Dropout(dropout),
                h=nn.ModuleList([Block(n_embd, n_head, dropout, bias, upcast_attention) for _ in range(n_layer)]),
                ln_f=nn.LayerNorm(n_embd, bias=bias),
            )
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying (Press & Wolf 2017)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @property
    def vocab_size(self) -> int:
        return self.lm_head.out_features

    def pipeline_stage(self, stage: int, stages: int) -> GPT:
        """This model cut down, in place, to pipeline stage ``stage`` of ``stages`` (``distributed=pp``): its share
        of the blocks (as even as they divide; a ModuleDict keeps their names), the embeddings on the first stage,
        the final LayerNorm and the head on the last. Names stay the full model's, so checkpoints and
        ``model.safetensors`` line up with it. A stage maps ``(B, T)`` ids or ``(B, T, C)`` -> ``(B, T, C)`` or
        ``(B, T, vocab)`` logits."""
        n = len(self.transformer.h)
        lo, hi = n * stage // stages, n * (stage + 1) // stages
        self.transformer.h = nn.ModuleDict({str(i): self.transformer.h[i] for i in range(lo, hi)})
        if stage > 0:
            self.transformer.wte = self.transformer.wpe = None
        if stage < stages - 1:
            self.transformer.ln_f = self.lm_head = None
        return self

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        chunk_tokens: int = 0,
        fused: nn.Module | None = None,
    ) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` of token ids ``idx`` ``(B, T)``; with ``targets`` ``(B, T)`` and ``chunk_tokens``
        the mean cross-entropy instead (``chunked_cross_entropy``, or the Liger module ``fused``)."""
        if self.transformer.wte is not None:  # None: a later pipeline stage, given the previous one's (B, T, C)
            pos = torch.arange(idx.shape[1], device=idx.device)
            idx = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        x, blocks = idx, self.transformer.h
        for block in blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks:
            x = block(x)
        if self.lm_head is None:  # a pipeline stage before the last: its output goes to the next
            return x
        if targets is not None and (chunk_tokens or fused is not None):
            h, weight = self.transformer.ln_f(x).flatten(0, 1), self.lm_head.weight
            weight = weight.to_local() if hasattr(weight, "to_local") else weight  # tp: a replicated DTensor
            if fused is not None:
                return fused(weight, h, targets.flatten())
            return chunked_cross_entropy(h, weight, targets.flatten(), chunk_tokens)
        return self.lm_head(self.transformer.ln_f(x))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """``generate(self, ...)`` fed at most ``block_size`` tokens at a time; see the module function."""
        return generate(self, idx, max_new_tokens, temperature, top_k, generator, context=self.block_size)


@torch.no_grad()
def generate(
    model: nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    context: int | None = None,
) -> torch.Tensor:
    """Sample ``max_new_tokens`` tokens after the prompt ``idx`` ``(B, T0)`` int64; returns
    ``(B, T0 + max_new_tokens)``.

    Any model whose output (or its ``.logits``) is ``(B, T, vocab)``; the last ``context`` tokens, ``temperature``,
    ``top_k``, no KV cache (nanoGPT's ``generate``, https://github.com/karpathy/nanoGPT/blob/master/model.py).

    Raises:
        ValueError: ``temperature`` <= 0.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    for _ in range(max_new_tokens):
        window = idx if context is None else idx[:, -context:]
        out = model(window)
        logits = getattr(out, "logits", out)[:, -1, :].float() / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        nxt = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)
        idx = torch.cat((idx, nxt), dim=1)
    return idx


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets``, a chunk at a time: only the gradients of
    ``hidden`` ``(N, C)`` and ``weight`` ``(V, C)`` are kept, never the ``(N, V)`` logits. Liger Kernel's fused
    linear cross-entropy in plain PyTorch (Hsu et al. 2024, arXiv:2410.10989); docs/language-models.md."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        n = targets.numel()
        loss = torch.zeros((), device=hidden.device, dtype=torch.float32)
        d_hidden = torch.empty_like(hidden)
        d_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
        for start in range(0, n, chunk):
            h, t = hidden[start : start + chunk], targets[start : start + chunk]
            logits = (h @ weight.to(h.dtype).t()).float()
            loss += F.cross_entropy(logits, t, reduction="sum")
            grad = logits.softmax(-1)  # d(sum of the losses)/d logits = softmax - one-hot
            grad[torch.arange(len(t), device=t.device), t] -= 1
            grad = (grad / n).to(h.dtype)
            d_hidden[start : start + chunk] = grad @ weight.to(h.dtype)
            d_weight += (grad.t() @ h).float()
        ctx.save_for_backward(d_hidden, d_weight.to(weight.dtype))
        return loss / n

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        d_hidden, d_weight = ctx.saved_tensors
        return d_hidden * grad_loss.to(d_hidden.dtype), d_weight * grad_loss.to(d_weight.dtype), None, None


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """Mean cross-entropy (nats per token) of the logits ``hidden @ weight.T`` (``hidden`` ``(N, C)``, ``weight``
    ``(V, C)``) against ``targets`` ``(N,)`` int64, ``chunk_tokens`` positions at a time, holding no ``(N, V)``
    tensor for the backward (``_ChunkedLinearCrossEntropy``)."""
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk_tokens)
