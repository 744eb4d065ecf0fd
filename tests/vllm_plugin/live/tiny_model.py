"""Make a tiny Llama and a byte-level tokenizer locally (no download): ``python tiny_model.py DIR``.

The model: transformers' ``LlamaConfig`` with 2 layers, hidden size 128, 2 heads of 64 (a head size
vLLM's CPU attention supports), random weights from a fixed seed, float32. The tokenizer: byte-level
BPE with no merges (one token per byte, 256 + 2 special tokens), saved as a ``PreTrainedTokenizerFast``.
"""
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


def make(out: str) -> None:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["<s>"], vocab["</s>"] = len(vocab), len(vocab) + 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out)


if __name__ == "__main__":
    make(sys.argv[1])
