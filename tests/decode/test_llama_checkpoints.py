"""The decode loop's model reads a transformers checkpoint exactly or refuses it (examples/llama.py,
examples/hf_oracle.py, docs/kv_cache.md section 4). Tiny checkpoints are saved here by the installed
transformers (random weights from a seed): a Llama 3 (rope base 500,000, llama3 rope scaling,
attention and MLP biases), a plain Llama, a Qwen2 (q/k/v biases) and a tied-embedding Llama (its own
head_dim, linear rope scaling). On each, in float64: the model's logits over a prompt equal
transformers' forward pass's, and its greedy tokens on contiguous KV (the decode loop's
``contiguous_decode``) equal transformers' own ``generate`` (its model code, its KV cache), forks
included. Configs the model cannot run exactly (yarn or dynamic rope, gelu, Qwen2's sliding window,
a field nobody reads, a missing directory, no transformers) raise one line naming the field and value.

Transformers computes RMSNorm and the rotary angles in float32 whatever the weights' dtype, so float64
logits agree to about 1e-6, not to float64's precision: :data:`LOGIT_ATOL` is 1e-5; a wrong rope base
or a dropped bias moves them by more than 1e-2 (:func:`test_the_logit_check_can_fail`)."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys

import pytest
import torch

from harness.paths import EXAMPLES

transformers = pytest.importorskip("transformers", minversion="4.57",
                                   reason="the checkpoint tests need transformers>=4.57 (the [test] extra)")
sys.path.insert(0, str(EXAMPLES))
import decode_loop as dl  # noqa: E402
from hf_oracle import HFOracle, hf_greedy  # noqa: E402
from llama import Llama, RopeScaling, UnsupportedCheckpoint, read_config, rope_inv_freq  # noqa: E402

from gpupool.kv_cache import attention  # noqa: E402

pytestmark = pytest.mark.strict_gpu_off  # no pool kernel runs here

TF5 = int(transformers.__version__.split(".")[0]) >= 5
LOGIT_ATOL = 1e-5
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # head_dim 16: wavelengths 6, 33, 167, ...: all 3 bands
SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
KINDS = {  # name: (model type, config fields besides SIZES and the rope settings, rope base, rope scaling)
    "llama3": ("llama", dict(attention_bias=True, mlp_bias=True, head_dim=16), 500000.0, LLAMA3_ROPE),
    "llama": ("llama", {}, 10000.0, None),
    "qwen2": ("qwen2", {}, 1000000.0, None),
    "tied": ("llama", dict(tie_word_embeddings=True, head_dim=12), 10000.0, {"rope_type": "linear", "factor": 2.0}),
}


def save_checkpoint(path, kind: str, seed: int = 0, **fields) -> str:
    """A tiny checkpoint of ``kind`` (KINDS) saved by the installed transformers into ``path``, in its own
    config layout (rope settings in ``rope_parameters`` from 5 on), weights random from ``seed`` and
    scaled so that logits are O(1) and greedy tokens vary; ``fields`` override config fields."""
    model_type, extra, theta, scaling = KINDS[kind]
    if TF5:
        rope = dict(rope_parameters={"rope_theta": theta, **(scaling or {"rope_type": "default"})})
    else:
        rope = dict(rope_theta=theta, rope_scaling=scaling)
    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[model_type]
    config = config_cls(**{**SIZES, **extra, **rope, **fields})
    model = model_cls(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:  # embeddings O(1), projections scaled by their fan-in
                p.copy_(torch.randn(p.shape, generator=g) / (1 if "embed" in name else p.shape[1] ** 0.5))
            else:  # norm weights near 1, biases near 0
                p.copy_(("norm" in name) + 0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(path))
    return str(path)


class Checkpoints(dict):
    """KINDS' checkpoints, each saved when first asked for (the quick tests use some only)."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, kind: str) -> str:
        self[kind] = save_checkpoint(self.root / kind, kind)
        return self[kind]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return Checkpoints(tmp_path_factory.mktemp("checkpoints"))


def prompts(n: int = 3, vocab: int = SIZES["vocab_size"], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for length in (11, 5, 17, 8)[:n]]


def our_logits(model: Llama, prompt: list[int]) -> torch.Tensor:
    """The model's logits ``[T, vocab]`` over ``prompt`` in one pass (causal attention over its own K/V)."""
    def attend(layer, q, k, v):
        return attention(q[None], k[None], v[None], torch.tensor([q.shape[0]]))[0]

    return model.forward(torch.tensor(prompt), torch.arange(len(prompt)), attend)


def hf_logits(oracle: HFOracle, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return oracle.model(torch.tensor([prompt])).logits[0]


def edited(checkpoints, tmp_path, kind: str, edit) -> str:
    """A copy of checkpoint ``kind`` whose config.json dict ``edit`` changed."""
    path = tmp_path / "edited"
    shutil.copytree(checkpoints[kind], path)
    raw = json.loads((path / "config.json").read_text())
    edit(raw)
    (path / "config.json").write_text(json.dumps(raw))
    return str(path)


def assert_logits_equal(path):
    ours, oracle = Llama.from_pretrained(path, torch.float64), HFOracle(path, torch.float64)
    hf_inv = oracle.model.model.rotary_emb.inv_freq
    torch.testing.assert_close(ours.inv_freq, hf_inv.to(torch.float64), rtol=1e-6, atol=0)
    for prompt in prompts():
        torch.testing.assert_close(our_logits(ours, prompt), hf_logits(oracle, prompt), rtol=0, atol=LOGIT_ATOL)


def assert_greedy_equal(path, max_new: int = 9):
    """Three prompts and a fork of the first (first token chosen): our tokens on contiguous KV equal
    transformers' ``generate`` (one batched call)."""
    ours, oracle = Llama.from_pretrained(path, torch.float64), HFOracle(path, torch.float64)
    ps = prompts()
    reqs = [dl.Request(i, p, max_new) for i, p in enumerate(ps)]
    reqs.append(dl.Request(len(ps), ps[0], max_new, fork_of=0, first_token=7))
    want = oracle.greedy([r.prompt for r in reqs], max_new, [r.first_token for r in reqs])
    assert [dl.contiguous_decode(ours, r.prompt, r.max_new, r.first_token) for r in reqs] == want
    assert all(len(t) == max_new for t in want) and want[-1][0] == 7 and want[-1] != want[0]


# ---- the config is read --------------------------------------------------------------------------------
def test_the_config_is_read(checkpoints):
    """The Llama 3 and Qwen2 settings land in LlamaConfig, from the installed transformers' layout."""
    c = read_config(checkpoints["llama3"])
    assert c.rope_theta == 500000.0 and c.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    assert (c.qkv_bias, c.o_bias, c.mlp_bias, c.tie_word_embeddings) == (True, True, True, False)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers, c.vocab_size) == (4, 2, 16, 2, 96)
    c = read_config(checkpoints["qwen2"])
    assert (c.rope_theta, c.rope_scaling, c.qkv_bias, c.o_bias, c.mlp_bias) == (1e6, None, True, False, False)


@pytest.mark.slow
def test_the_config_is_read_more(checkpoints):
    """The tied one's head_dim, linear scaling and tied head; the plain one's defaults."""
    c = read_config(checkpoints["tied"])
    assert (c.tie_word_embeddings, c.head_dim, c.rope_scaling) == (True, 12, RopeScaling("linear", 2.0))
    assert read_config(checkpoints["llama"]) == dataclasses.replace(
        c, head_dim=8, rope_scaling=None, tie_word_embeddings=False)


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_logits_equal_transformers(checkpoints, kind):
    assert_logits_equal(checkpoints[kind])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "tied"])
def test_logits_equal_transformers_more(checkpoints, kind):
    assert_logits_equal(checkpoints[kind])


def test_greedy_equals_generate(checkpoints):
    """The Llama 3 checkpoint (base 500,000, llama3 scaling, biases): the quick case."""
    assert_greedy_equal(checkpoints["llama3"])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2", "tied"])
def test_greedy_equals_generate_more(checkpoints, kind):
    assert_greedy_equal(checkpoints[kind], max_new=12)


def test_the_other_config_layout_is_read_or_refused(checkpoints, tmp_path):
    """A Llama 3 config.json in the other transformers major's layout: transformers 5 reads 4's
    ``rope_theta`` / ``rope_scaling`` (and so does the loader, logits equal); 4.57 ignores 5's
    ``rope_parameters`` (its model would use base 10,000), so the loader refuses it."""
    def other_layout(raw):
        if TF5:
            rope = raw.pop("rope_parameters")
            raw["rope_theta"] = rope.pop("rope_theta")
            raw["rope_scaling"] = rope
        else:
            raw["rope_parameters"] = {"rope_theta": raw.pop("rope_theta"), **raw.pop("rope_scaling")}

    path = edited(checkpoints, tmp_path, "llama3", other_layout)
    if TF5:
        assert read_config(path) == read_config(checkpoints["llama3"])
        assert_logits_equal(path)
    else:
        with pytest.raises(UnsupportedCheckpoint, match="rope_parameters .*'rope_theta': 500000.0"):
            read_config(path)


# ---- the checks can fail -------------------------------------------------------------------------------
def test_the_logit_check_can_fail(checkpoints):
    """The errors the loader had: the rope base read the old way under transformers 5 (10,000 for
    500,000), llama3 scaling and biases dropped. Each moves the logits far past LOGIT_ATOL."""
    path = checkpoints["llama3"]
    good, oracle = Llama.from_pretrained(path, torch.float64), HFOracle(path, torch.float64)
    prompt = prompts(1)[0]
    want = hf_logits(oracle, prompt)
    faults = [dataclasses.replace(good.cfg, rope_theta=10000.0), dataclasses.replace(good.cfg, rope_scaling=None)]
    for cfg in faults:
        assert (our_logits(Llama(cfg, good.w, good.dtype, good.device), prompt) - want).abs().max() > 1e-2
    no_bias = {k: v for k, v in good.w.items() if not k.endswith(".q_bias")}
    assert (our_logits(Llama(good.cfg, no_bias, good.dtype, good.device), prompt) - want).abs().max() > 1e-2


# ---- the oracle ----------------------------------------------------------------------------------------
def test_the_oracle_batches_and_ignores_the_checkpoints_eos(checkpoints, tmp_path):
    """One left-padded batch gives each prompt's tokens alone; the checkpoint's generation_config.json
    (an end-of-sequence id greedy reaches, a repetition penalty) changes nothing; ``eos_token_id``
    given stops a prompt there; hf_greedy is one prompt of it."""
    path = str(tmp_path / "eos")
    shutil.copytree(checkpoints["llama3"], path)
    oracle = HFOracle(path, torch.float64)
    ps = prompts(3)
    batch = oracle.greedy(ps, 6)
    assert batch == [oracle.greedy([p], 6)[0] for p in ps]
    assert oracle.greedy(ps[:2], [3, 6], [None, 5]) == [batch[0][:3], [5] + hf_greedy(path, ps[1] + [5], 5)]
    eos = batch[0][2]
    (tmp_path / "eos" / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "repetition_penalty": 3.0}))
    again = HFOracle(path, torch.float64)
    assert again.greedy(ps, 6) == batch
    assert again.greedy(ps[:1], 6, eos_token_id=eos) == [batch[0][:batch[0].index(eos) + 1]]


@pytest.fixture(scope="module")
def plain_oracle(checkpoints):
    return HFOracle(checkpoints["llama"], torch.float64)


@pytest.mark.parametrize("args", [([[]], 3), ([[1, 2]], 0), ([[1, 96]], 3), ([[-1]], 3), ([[1]], 3, [96]),
                                  ([[1.5]], 3), ([[1]], [3, 3]), ([[True]], 3), ([[1]], 2.0), ([], 3), (None, 3),
                                  ([5], 3), ([[1]], 3, None, 96), ([[1]], 3, None, -1), ([[1]], 10**30),
                                  ([[1], [2]], 3, [1])])
def test_the_oracle_refuses_bad_arguments(plain_oracle, args):
    with pytest.raises(ValueError, match="^greedy: "):
        plain_oracle.greedy(*args)


# ---- what the loader refuses ---------------------------------------------------------------------------
def _rope_edit(**rope):
    """Replace the rope settings, in the installed transformers' layout."""
    def edit(raw):
        if TF5:
            raw["rope_parameters"] = {"rope_theta": 10000.0, **rope}
        else:
            raw["rope_scaling"] = rope
    return edit


REFUSED = {  # name: (kind, config edit, what the one line says)
    "yarn": ("llama", _rope_edit(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
             "rope type 'yarn' is not supported"),
    "dynamic": ("llama", _rope_edit(rope_type="dynamic", factor=2.0), "rope type 'dynamic' is not supported"),
    "llama3 extra": ("llama", _rope_edit(**LLAMA3_ROPE, attention_factor=2.0),
                     "rope setting attention_factor = 2.0 is not read"),
    "gelu": ("llama", lambda raw: raw.update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    "sliding": ("qwen2", lambda raw: raw.update(use_sliding_window=True, sliding_window=8, max_window_layers=0),
                "use_sliding_window = true"),
    "mistral": ("llama", lambda raw: raw.update(model_type="mistral"), "model_type 'mistral' is not supported"),
    "architecture": ("llama", lambda raw: raw.update(architectures=["LlamaForSequenceClassification"]),
                     "architectures \\['LlamaForSequenceClassification'\\] is not supported"),
    "quantized": ("llama", lambda raw: raw.update(quantization_config={"quant_method": "fp8"}),
                  "config field quantization_config = {'quant_method': 'fp8'} is not read"),
    "qwen2 attention_bias": ("qwen2", lambda raw: raw.update(attention_bias=False),
                             "config field attention_bias = False is not read"),
    "partial rotary": ("llama", lambda raw: raw.update(partial_rotary_factor=0.5),
                       "partial_rotary_factor = 0.5 is not supported"),
    "a generation setting": ("llama", lambda raw: raw.update(repetition_penalty=1.3),
                             "config field repetition_penalty = 1.3 is not read"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_an_unsupported_config_is_one_line(checkpoints, tmp_path, name):
    kind, edit, says = REFUSED[name]
    path = edited(checkpoints, tmp_path, kind, edit)
    with pytest.raises(UnsupportedCheckpoint, match=says) as e:
        Llama.from_pretrained(path, torch.float64)
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value) and str(e.value).startswith(path)


def test_a_missing_or_broken_checkpoint_is_one_line(checkpoints, tmp_path, monkeypatch):
    cases = {str(tmp_path / "nope"): "no such directory", str(tmp_path): "not a checkpoint directory"}
    (tmp_path / "file").write_text("x")
    cases[str(tmp_path / "file")] = "not a directory"
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    shutil.copy(os.path.join(checkpoints["llama"], "config.json"), weightless)
    cases[str(weightless)] = "transformers cannot load it"
    bad_json = tmp_path / "bad_json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{")
    cases[str(bad_json)] = "config.json cannot be read"
    for path, says in cases.items():
        for load in (lambda p: Llama.from_pretrained(p), lambda p: hf_greedy(p, [1], 2)):
            with pytest.raises(UnsupportedCheckpoint, match=says) as e:
                load(path)
            assert "\n" not in str(e.value)
    for path in (None, 3):
        with pytest.raises(UnsupportedCheckpoint, match="not a path"):
            Llama.from_pretrained(path)
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(UnsupportedCheckpoint, match="needs transformers"):
        Llama.from_pretrained(checkpoints["llama"])


def test_a_missing_weight_is_refused(checkpoints, tmp_path):
    """A checkpoint whose files lack a weight the config needs (transformers would initialise it at random)."""
    path = edited(checkpoints, tmp_path, "llama", lambda raw: raw.update(attention_bias=True))
    with pytest.raises(UnsupportedCheckpoint, match="weights missing keys: model.layers.0.self_attn.k_proj.bias"):
        Llama.from_pretrained(path, torch.float64)


def test_random_models_take_the_new_settings():
    """Llama.random with biases, tied embeddings and llama3 scaling: its weights and inverse frequencies."""
    cfg = dl.LlamaConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                         intermediate_size=32, qkv_bias=True, mlp_bias=True, tie_word_embeddings=True,
                         rope_theta=500000.0, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64))
    m = Llama.random(cfg, seed=3)
    assert m.w["lm_head"] is m.w["embed"] and {"0.q_bias", "0.k_bias", "0.v_bias", "0.down_bias"} <= set(m.w)
    assert "0.o_bias" not in m.w and our_logits(m, [1, 2, 3]).shape == (3, 32)
    plain = rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None))
    inv = rope_inv_freq(cfg)
    assert inv[0] == plain[0] and inv[-1] == plain[-1] / 8 and plain[1] / 8 < inv[1] < plain[1]  # the 3 bands


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_the_decode_loop_on_a_checkpoint_equals_transformers_generate(checkpoints, kind, capsys):
    """``examples/decode_loop.py --model``: the host pool, a decode window and speculative decoding on the
    checkpoint give transformers' own tokens (second turns and the fork included); the command exits 0
    only when every mode's tokens equal both oracles'."""
    vocab = SIZES["vocab_size"]
    argv = ["--model", checkpoints[kind], "--modes", "host", "window", "spec", "--steps", "4", "--draft", "2",
            "--spec-steps", "2", "--requests", "3", "--prompt-len", "9", "--prefix-len", "5", "--max-new", "6",
            "--num-blocks", "24", "--block-size", "4", "--max-blocks-per-req", "12"]
    assert dl.main(argv) == 0, capsys.readouterr()
    out = capsys.readouterr().out.split("columns:")[0]
    rows = [line.split() for line in out.strip().splitlines()[1:]]
    assert len(rows) == 3 and all(r[4:6] == ["yes", "yes"] for r in rows), out
    assert vocab
