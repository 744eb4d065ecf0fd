"""Make a tiny model and a byte-level tokenizer locally (no download): ``python tiny_model.py DIR [KIND]``.

KIND ``llama`` (the default): transformers' ``LlamaConfig`` with 2 layers, hidden size 128, 2 heads of
64 (a head size vLLM's CPU attention supports). KIND ``gemma3``: a Gemma 3-style hybrid,
``Gemma3TextConfig`` with 3 sliding-window layers (a window of ``SLIDING_WINDOW`` tokens) then a
full-attention layer (Gemma 3 repeats 5 and 1), the same sizes, so vLLM builds four KV cache groups,
three sliding-window and one full-attention. Random weights from a fixed
seed, float32. The tokenizer: byte-level BPE with no merges (one token per byte, 256 + 2 special
tokens), saved as a ``PreTrainedTokenizerFast``.
"""
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SLIDING_WINDOW = 32  # tokens: one block of vLLM's CPU attention


def make(out: str, kind: str = "llama") -> None:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["<s>"], vocab["</s>"] = len(vocab), len(vocab) + 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    sizes = dict(vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_attention_heads=2,
                 num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=vocab["<s>"],
                 eos_token_id=vocab["</s>"])
    if kind == "gemma3":
        cfg = Gemma3TextConfig(**sizes, num_hidden_layers=4, head_dim=64, query_pre_attn_scalar=64,
                               sliding_window=SLIDING_WINDOW, pad_token_id=vocab["</s>"],
                               layer_types=["sliding_attention"] * 3 + ["full_attention"])
        model_cls = Gemma3ForCausalLM
    else:
        cfg = LlamaConfig(**sizes, num_hidden_layers=2, tie_word_embeddings=False)
        model_cls = LlamaForCausalLM
    torch.manual_seed(0)
    model = model_cls(cfg).to(torch.float32)
    model.save_pretrained(out)


if __name__ == "__main__":
    make(*sys.argv[1:3])
