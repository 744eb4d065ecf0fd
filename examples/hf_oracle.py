"""An oracle nobody here wrote: transformers' own greedy decoding of a local checkpoint, its own model
code and its own KV cache (``generate`` with ``do_sample=False``), to compare the decode loop's tokens
with (docs/kv_cache.md section 4). Needs ``transformers`` >= 4.57; nothing is downloaded.

    oracle = HFOracle("ckpt/", dtype=torch.float64)
    oracle.greedy([[5, 9, 2], [7, 7]], max_new=8)                  # two prompts, one batched call
    oracle.greedy([[5, 9, 2]], max_new=8, first_tokens=[1])        # a fork: its first token chosen
    hf_greedy("ckpt/", [5, 9, 2], 8, torch.float64, "cpu")         # one prompt, the model loaded for it

A fork (a prompt continued with a chosen first token, as the decode loop's fork) is ``generate`` on
the prompt plus that token for one token fewer, the token prepended. Prompts of one call run as one
batch, left-padded with an attention mask (transformers then numbers the positions from each prompt's
first token, so the greedy tokens are those of one call per prompt; tests/decode/test_llama_checkpoints.py
checks it in float64).
"""
from __future__ import annotations

import torch

from llama import UnsupportedCheckpoint, load_hf_model


class HFOracle:
    """transformers' model of the checkpoint ``path`` (weights of ``dtype`` on ``device``), loaded once,
    for :meth:`greedy`. Raises :class:`llama.UnsupportedCheckpoint` (one line) if ``path`` is not a
    ``llama`` / ``qwen2`` checkpoint whose weights all load, or ``transformers`` is missing or too old."""

    def __init__(self, path, dtype: torch.dtype = torch.float64, device="cpu"):
        self.model = load_hf_model(path, dtype, device)
        from transformers import GenerationConfig  # importable: the model loaded

        self._generation_config = GenerationConfig
        self.vocab_size = self.model.config.vocab_size
        self.max_positions = self.model.config.max_position_embeddings

    def greedy(self, prompts: list[list[int]], max_new: int | list[int], first_tokens: list[int | None] | None = None,
               eos_token_id: int | None = None) -> list[list[int]]:
        """Greedy tokens ``list[int]`` per prompt (token ids in ``0 .. vocab_size - 1``, at least one per
        prompt): ``max_new`` new tokens each (one int for all, or one per prompt; with the prompt, at most
        the checkpoint's ``max_position_embeddings``). ``first_tokens[i]``, where not None, is prompt i's
        first new token instead of its greedy one (a fork). Generation does not stop at an
        end-of-sequence token unless ``eos_token_id`` is given: then a prompt's tokens end at its first
        ``eos_token_id`` (included). Raises ValueError on a malformed argument."""
        n = len(prompts) if isinstance(prompts, (list, tuple)) else 0
        max_new = [max_new] * n if _is_int(max_new) else max_new
        first_tokens = [None] * n if first_tokens is None else first_tokens
        if not all(isinstance(a, (list, tuple)) and len(a) == n for a in (max_new, first_tokens)) or n == 0:
            raise ValueError(f"greedy: 1 or more prompts, and an int or one per prompt for max_new and first_tokens; "
                             f"got {n} prompts, max_new {max_new!r}, first_tokens {first_tokens!r}")
        prompts = [list(p) if isinstance(p, (list, tuple)) else p for p in prompts]
        for i, (p, m, f) in enumerate(zip(prompts, max_new, first_tokens)):
            if not isinstance(p, list) or not p or not all(self._is_token(t) for t in p) or \
                    not (f is None or self._is_token(f)):
                raise ValueError(f"greedy: prompt {i} must be 1 or more token ids in 0..{self.vocab_size - 1} "
                                 f"(and its first token one too), got {p!r}, first token {f!r}")
            if not _is_int(m) or not 1 <= m <= self.max_positions - len(p):
                raise ValueError(f"greedy: max_new of prompt {i} must be an int in 1..{self.max_positions - len(p)} "
                                 f"(the checkpoint's max_position_embeddings, {self.max_positions}, less the prompt's "
                                 f"{len(p)} tokens), got {m!r}")
        if not (eos_token_id is None or self._is_token(eos_token_id)):
            raise ValueError(f"greedy: eos_token_id must be None or a token id in 0..{self.vocab_size - 1}, "
                             f"got {eos_token_id!r}")
        inputs = [p + [f] if f is not None else list(p) for p, f in zip(prompts, first_tokens)]
        todo = [m - (f is not None) for m, f in zip(max_new, first_tokens)]  # tokens generate makes
        made = self._generate(inputs, max(todo), eos_token_id) if max(todo) > 0 else [[] for _ in prompts]
        out = []
        for f, k, toks in zip(first_tokens, todo, made):
            toks = ([f] if f is not None else []) + toks[:k]
            if eos_token_id is not None and eos_token_id in toks:
                toks = toks[:toks.index(eos_token_id) + 1]
            out.append(toks)
        return out

    def _is_token(self, t) -> bool:
        return _is_int(t) and 0 <= t < self.vocab_size

    def _generate(self, inputs: list[list[int]], max_new_tokens: int, eos_token_id: int | None) -> list[list[int]]:
        """``generate`` over ``inputs`` as one left-padded batch: each row's ``max_new_tokens`` new tokens."""
        dev = self.model.device
        width = max(len(p) for p in inputs)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in inputs], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in inputs], device=dev)
        # the checkpoint's own generation settings (an end-of-sequence id, penalties) are not the oracle's:
        # generate fills what its generation_config leaves unset from the model's, so both are this one
        config = self._generation_config(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, min_new_tokens=0,
                                         use_cache=True, eos_token_id=eos_token_id, pad_token_id=0)
        self.model.generation_config = config
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        return [row[width:].tolist() for row in out]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def hf_greedy(path, prompt_ids: list[int], max_new: int, dtype: torch.dtype = torch.float64, device="cpu",
              first_token: int | None = None) -> list[int]:
    """transformers' greedy ``max_new`` tokens after ``prompt_ids`` on the checkpoint ``path`` (its own KV
    cache, no end-of-sequence stop); with ``first_token``, a fork: that token first, then greedy. Loads
    the model for this one call (:class:`HFOracle` keeps it). Raises :class:`llama.UnsupportedCheckpoint`
    (see :class:`HFOracle`) or ValueError (see :meth:`HFOracle.greedy`)."""
    return HFOracle(path, dtype, device).greedy([prompt_ids], max_new, [first_token])[0]


__all__ = ["HFOracle", "hf_greedy", "UnsupportedCheckpoint"]
