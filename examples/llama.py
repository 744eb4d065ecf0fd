"""A small Llama-style decoder in plain torch for the decode-loop example (examples/decode_loop.py):
RMSNorm, rotary position embeddings, grouped-query attention, SwiGLU, tied nothing. Weights are
random from a seed (sizes from :class:`LlamaConfig`), or a local ``LlamaForCausalLM`` checkpoint's
when ``transformers`` is installed (:meth:`Llama.from_pretrained`; nothing is downloaded).

The model does not own a KV cache: :meth:`Llama.forward` takes the tokens of one pass with their
positions and an ``attend(layer, q, k, v)`` callback that stores the new K/V wherever the caller keeps
them (a paged cache through a slot mapping, or a contiguous one) and returns the attention output. So
the same weights and the same arithmetic run over paged and contiguous KV.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6


class Llama:
    """Weights of a Llama-style decoder (``w`` maps names to tensors of ``dtype`` on ``device``)."""

    def __init__(self, cfg: LlamaConfig, w: dict[str, torch.Tensor], dtype: torch.dtype, device):
        self.cfg, self.w, self.dtype, self.device = cfg, w, dtype, torch.device(device)
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
        self.inv_freq = inv.to(device)

    @staticmethod
    def random(cfg: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float64, device="cpu") -> "Llama":
        """Random weights from ``seed`` (scaled so that activations stay O(1) and greedy tokens vary)."""
        g = torch.Generator().manual_seed(seed)
        H, D, Hk, F = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads, cfg.intermediate_size

        def rnd(*shape, fan_in):
            return (torch.randn(*shape, generator=g, dtype=torch.float64) / fan_in ** 0.5).to(dtype).to(device)

        w = {"embed": rnd(cfg.vocab_size, H, fan_in=1), "norm": torch.ones(H, dtype=dtype, device=device),
             "lm_head": rnd(cfg.vocab_size, H, fan_in=H)}
        for i in range(cfg.num_layers):
            w[f"{i}.q"] = rnd(cfg.num_heads * D, H, fan_in=H)
            w[f"{i}.k"] = rnd(Hk * D, H, fan_in=H)
            w[f"{i}.v"] = rnd(Hk * D, H, fan_in=H)
            w[f"{i}.o"] = rnd(H, cfg.num_heads * D, fan_in=cfg.num_heads * D)
            w[f"{i}.gate"] = rnd(F, H, fan_in=H)
            w[f"{i}.up"] = rnd(F, H, fan_in=H)
            w[f"{i}.down"] = rnd(H, F, fan_in=F)
            w[f"{i}.attn_norm"] = torch.ones(H, dtype=dtype, device=device)
            w[f"{i}.mlp_norm"] = torch.ones(H, dtype=dtype, device=device)
        return Llama(cfg, w, dtype, device)

    @staticmethod
    def from_pretrained(path: str, dtype: torch.dtype = torch.float32, device="cpu") -> "Llama":
        """The weights of a local ``LlamaForCausalLM`` directory (needs ``transformers``; no download)."""
        from transformers import LlamaForCausalLM

        hf = LlamaForCausalLM.from_pretrained(path, local_files_only=True, torch_dtype=dtype)
        c = hf.config
        cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
                          num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                          head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                          intermediate_size=c.intermediate_size, rope_theta=getattr(c, "rope_theta", 10000.0),
                          rms_norm_eps=c.rms_norm_eps)
        sd = {k: v.to(device) for k, v in hf.state_dict().items()}
        w = {"embed": sd["model.embed_tokens.weight"], "norm": sd["model.norm.weight"],
             "lm_head": sd.get("lm_head.weight", sd["model.embed_tokens.weight"])}
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            w.update({f"{i}.q": sd[p + "self_attn.q_proj.weight"], f"{i}.k": sd[p + "self_attn.k_proj.weight"],
                      f"{i}.v": sd[p + "self_attn.v_proj.weight"], f"{i}.o": sd[p + "self_attn.o_proj.weight"],
                      f"{i}.gate": sd[p + "mlp.gate_proj.weight"], f"{i}.up": sd[p + "mlp.up_proj.weight"],
                      f"{i}.down": sd[p + "mlp.down_proj.weight"],
                      f"{i}.attn_norm": sd[p + "input_layernorm.weight"],
                      f"{i}.mlp_norm": sd[p + "post_attention_layernorm.weight"]})
        return Llama(cfg, w, dtype, device)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True) if x.dtype != torch.float64 else x.pow(2).mean(-1, keepdim=True)
        return (x * torch.rsqrt(var + self.cfg.rms_norm_eps).to(x.dtype)) * weight

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x: [T, heads, D]`` by its tokens' positions (the half-split layout of HF's Llama)."""
        ang = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)[:, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)[:, None, :]
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """Logits ``[T, vocab]`` of one pass over ``tokens, positions: int[T]``.
        ``attend(layer, q [T, Hq, D], k [T, Hk, D], v [T, Hk, D]) -> [T, Hq, D]`` stores the pass's K/V
        and attends (rotary embeddings already applied to q and k)."""
        c, w = self.cfg, self.w
        T = tokens.shape[0]
        x = w["embed"][tokens.long()]
        for i in range(c.num_layers):
            h = self._rms_norm(x, w[f"{i}.attn_norm"])
            q = (h @ w[f"{i}.q"].T).view(T, c.num_heads, c.head_dim)
            k = (h @ w[f"{i}.k"].T).view(T, c.num_kv_heads, c.head_dim)
            v = (h @ w[f"{i}.v"].T).view(T, c.num_kv_heads, c.head_dim)
            q, k = self._rope(q, positions), self._rope(k, positions)
            o = attend(i, q, k, v).reshape(T, c.num_heads * c.head_dim)
            x = x + o @ w[f"{i}.o"].T
            h = self._rms_norm(x, w[f"{i}.mlp_norm"])
            x = x + (torch.nn.functional.silu(h @ w[f"{i}.gate"].T) * (h @ w[f"{i}.up"].T)) @ w[f"{i}.down"].T
        return self._rms_norm(x, w["norm"]) @ w["lm_head"].T
