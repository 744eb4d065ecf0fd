"""A small Llama-style decoder in plain torch for the decode-loop example (examples/decode_loop.py):
RMSNorm, rotary position embeddings, grouped-query attention, SwiGLU. Weights are random from a seed
(sizes from :class:`LlamaConfig`), or a local ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` checkpoint's
when ``transformers`` is installed (:meth:`Llama.from_pretrained`; nothing is downloaded). The loader
reads every setting of the checkpoint's config that changes the arithmetic, or refuses the checkpoint
with :class:`UnsupportedCheckpoint`, one line naming the field and its value (docs/kv_cache.md section 4).

The model does not own a KV cache: :meth:`Llama.forward` takes the tokens of one pass with their
positions and an ``attend(layer, q, k, v)`` callback that stores the new K/V wherever the caller keeps
them (a paged cache through a slot mapping, or a contiguous one) and returns the attention output. So
the same weights and the same arithmetic run over paged and contiguous KV.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch


class UnsupportedCheckpoint(ValueError):
    """A checkpoint directory this loader cannot read exactly (or no checkpoint, or no ``transformers``):
    the message is one line naming the directory, the field and its value."""


@dataclass(frozen=True)
class RopeScaling:
    """transformers' rotary scaling of the inverse frequencies: ``rope_type`` ``"linear"`` (divide all by
    ``factor``) or ``"llama3"`` (Llama 3.1's: long wavelengths divided by ``factor``, short ones kept, a
    smooth ramp between; the other three fields are its ``rope_parameters`` of the same names)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes and settings of the decoder. ``qkv_bias``/``o_bias``: biases on the q, k, v / o projections
    (Llama's ``attention_bias`` sets both, Qwen2 has the first only); ``mlp_bias``: on gate, up, down;
    ``tie_word_embeddings``: the output head is the embedding matrix."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """The rotary inverse frequencies ``float64[head_dim / 2]``, by transformers' formulas (its
    ``modeling_rope_utils``: the default, ``_compute_linear_scaling_rope_parameters`` and
    ``_compute_llama3_parameters``), in float64 where transformers computes them in float32."""
    D = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    s = cfg.rope_scaling
    if s is None:
        return inv
    if s.rope_type == "linear":
        return inv / s.factor
    old_context = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old_context / s.low_freq_factor, old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)  # long wavelengths: divided by factor
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Llama:
    """Weights of a Llama-style decoder (``w`` maps names to tensors of ``dtype`` on ``device``; a
    projection's bias, where the config has one, is ``w[name + "_bias"]``)."""

    def __init__(self, cfg: LlamaConfig, w: dict[str, torch.Tensor], dtype: torch.dtype, device):
        self.cfg, self.w, self.dtype, self.device = cfg, w, dtype, torch.device(device)
        self.inv_freq = rope_inv_freq(cfg).to(device)

    @staticmethod
    def random(cfg: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float64, device="cpu") -> "Llama":
        """Random weights from ``seed`` (scaled so that activations stay O(1) and greedy tokens vary); the
        config's biases are random too, drawn after the weights."""
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
        if cfg.tie_word_embeddings:
            w["lm_head"] = w["embed"]
        for name in _bias_names(cfg):
            w[name + "_bias"] = rnd(w[name].shape[0], fan_in=H)
        return Llama(cfg, w, dtype, device)

    @staticmethod
    def from_pretrained(path, dtype: torch.dtype = torch.float32, device="cpu") -> "Llama":
        """The weights of the local ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` directory ``path``, of
        ``dtype`` on ``device`` (needs ``transformers`` >= 4.57; nothing is downloaded). Every setting of
        its config is read (:func:`read_config`) and every weight used, else :class:`UnsupportedCheckpoint`,
        one line naming the field and its value (docs/kv_cache.md section 4)."""
        cfg = read_config(path)
        sd = load_hf_model(path, dtype).state_dict()
        names = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}
        parts = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                 "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
                 "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
        for i in range(cfg.num_layers):
            names.update({f"{i}.{k}": f"model.layers.{i}.{p}.weight" for k, p in parts.items()})
        names.update({b + "_bias": names[b][:-len("weight")] + "bias" for b in _bias_names(cfg)})
        if cfg.tie_word_embeddings:
            names["lm_head"] = names["embed"]
        unread = sorted(set(sd) - set(names.values()) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
        missing = sorted(set(names.values()) - set(sd))
        if unread or missing:
            raise _refuse(path, f"weights not read: {unread[:3]}, weights missing: {missing[:3]}")
        return Llama(cfg, {k: sd[n].to(device) for k, n in names.items()}, dtype, device)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True) if x.dtype != torch.float64 else x.pow(2).mean(-1, keepdim=True)
        return (x * torch.rsqrt(var + self.cfg.rms_norm_eps).to(x.dtype)) * weight

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``x @ w[name].T``, plus the projection's bias where it has one."""
        y = x @ self.w[name].T
        bias = self.w.get(name + "_bias")
        return y if bias is None else y + bias

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
            q = self._linear(h, f"{i}.q").view(T, c.num_heads, c.head_dim)
            k = self._linear(h, f"{i}.k").view(T, c.num_kv_heads, c.head_dim)
            v = self._linear(h, f"{i}.v").view(T, c.num_kv_heads, c.head_dim)
            q, k = self._rope(q, positions), self._rope(k, positions)
            o = attend(i, q, k, v).reshape(T, c.num_heads * c.head_dim)
            x = x + self._linear(o, f"{i}.o")
            h = self._rms_norm(x, w[f"{i}.mlp_norm"])
            x = x + self._linear(torch.nn.functional.silu(self._linear(h, f"{i}.gate")) * self._linear(h, f"{i}.up"),
                                 f"{i}.down")
        return self._rms_norm(x, w["norm"]) @ w["lm_head"].T


def _bias_names(cfg: LlamaConfig) -> list[str]:
    """The projections of ``cfg`` that have a bias (names of :attr:`Llama.w`)."""
    per_layer = ["q", "k", "v"] * cfg.qkv_bias + ["o"] * cfg.o_bias + ["gate", "up", "down"] * cfg.mlp_bias
    return [f"{i}.{p}" for i in range(cfg.num_layers) for p in per_layer]


# ---- reading a checkpoint ----------------------------------------------------------------------------
TRANSFORMERS_FLOOR = (4, 57)  # pyproject.toml's test extra: transformers>=4.57
CAUSAL_LM = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}  # the model types read, and their class
# config.json fields that do not change a forward pass: ids, names, versions, the saved dtype, and
# settings of training (dropout, initialisation, tensor-parallel pretraining) or of a context limit
# nothing here enforces
_INERT = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "tokenizer_class",
    "id2label", "label2id", "problem_type", "finetuning_task", "prefix", "task_specific_params", "return_dict",
    "output_hidden_states", "output_attentions", "torchscript", "use_bfloat16", "tf_legacy_loss",
    "chunk_size_feed_forward", "initializer_range", "attention_dropout", "pretraining_tp", "max_position_embeddings"})
# the fields read (or checked) for each model type; any other field must be inert or hold
# transformers' base-class default, else the checkpoint is refused
_SIZES = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "tie_word_embeddings", "rope_theta",
          "rope_scaling", "rope_parameters", "partial_rotary_factor"}
_READ = {"llama": _SIZES | {"attention_bias", "mlp_bias"},
         "qwen2": _SIZES | {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}}
# the rotary settings read for each rope type (besides rope_type / type, rope_theta, partial_rotary_factor)
_ROPE_FIELDS = {"default": (), "linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def _refuse(path, what: str) -> UnsupportedCheckpoint:
    return UnsupportedCheckpoint(" ".join(f"{path}: {what}".split()))  # one line, whatever the values hold


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def _transformers(path):
    """The installed ``transformers`` (at least :data:`TRANSFORMERS_FLOOR`), else UnsupportedCheckpoint."""
    try:
        import transformers
    except ImportError:
        raise _refuse(path, "reading a checkpoint needs transformers (pip install 'transformers>=4.57')") from None
    if _version(transformers) < TRANSFORMERS_FLOOR:
        raise _refuse(path, f"transformers {transformers.__version__} is older than 4.57 (pip install -U transformers)")
    return transformers


def _version(transformers) -> tuple[int, int]:
    major, minor = (transformers.__version__.split(".") + ["0"])[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _config_json(path) -> dict:
    """``path``'s config.json as saved; UnsupportedCheckpoint if ``path`` is not a checkpoint directory."""
    if not isinstance(path, (str, os.PathLike)):
        raise _refuse(repr(path), "not a path")
    if not os.path.isdir(path):
        raise _refuse(path, "not a directory" if os.path.exists(path) else "no such directory")
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise _refuse(path, "not a checkpoint directory (no config.json)")
    try:
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise _refuse(path, f"config.json cannot be read ({e})") from None
    if not isinstance(raw, dict):
        raise _refuse(path, "config.json is not a JSON object")
    if raw.get("model_type") not in CAUSAL_LM:
        raise _refuse(path, f"model_type {raw.get('model_type')!r} is not supported (llama and qwen2 are)")
    return raw


def load_hf_model(path, dtype: torch.dtype = torch.float32, device="cpu"):
    """transformers' own causal LM of the local checkpoint ``path`` (``llama`` or ``qwen2``), in eval mode,
    weights of ``dtype`` on ``device``, its attention torch's ``scaled_dot_product_attention``; nothing
    is downloaded. Raises :class:`UnsupportedCheckpoint` (one line) if ``path`` is not such a
    checkpoint, ``transformers`` is missing or older than 4.57, or a weight the model needs is missing
    from the files, is left over or has the wrong shape."""
    raw = _config_json(path)
    tf = _transformers(path)
    try:
        # sdpa: transformers' eager attention turns a left-padded float64 batch into NaN (its mask's
        # float64 minimum is -inf in its float32 softmax: a padding query attends to nothing)
        model, info = tf.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                              attn_implementation="sdpa", output_loading_info=True)
    except Exception as e:  # the library's many error types: one line for the command's usage message
        raise _refuse(path, f"transformers cannot load it ({_first_line(e)})") from None
    if type(model).__name__ != CAUSAL_LM[raw["model_type"]]:
        raise _refuse(path, f"loads as {type(model).__name__}, not {CAUSAL_LM[raw['model_type']]}")
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        bad = sorted(str(k) for k in info.get(kind) or [])
        if bad:
            more = " ..." if len(bad) > 3 else ""
            raise _refuse(path, f"weights {kind.replace('_', ' ')}: {', '.join(bad[:3])}{more}")
    return model.to(device).eval()


def read_config(path) -> LlamaConfig:
    """The :class:`LlamaConfig` of the local checkpoint ``path``: every field of its config.json is read,
    inert (ids, names, training settings) or transformers' base default, or the checkpoint is refused
    with :class:`UnsupportedCheckpoint` naming the field and its value. Values are read as the installed
    transformers reads them (4.57's ``rope_theta`` / ``rope_scaling``, 5's ``rope_parameters``)."""
    raw = _config_json(path)
    tf = _transformers(path)
    mt = raw["model_type"]
    if raw.get("architectures") not in (None, [CAUSAL_LM[mt]]):
        raise _refuse(path, f"architectures {raw['architectures']!r} is not supported (a {mt} checkpoint must be "
                            f"[{CAUSAL_LM[mt]!r}])")
    base = (getattr(tf, "PreTrainedConfig", None) or tf.PretrainedConfig)().to_dict()
    for key, value in raw.items():
        default = key in base and json.loads(json.dumps(base[key], default=str)) == value
        if key not in _READ[mt] and key not in _INERT and not default:
            raise _refuse(path, f"config field {key} = {value!r} is not read by this loader")
    try:
        c = tf.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # the library's many error types: one line for the command's usage message
        raise _refuse(path, f"transformers cannot read config.json ({_first_line(e)})") from None
    if c.hidden_act != "silu":
        raise _refuse(path, f"hidden_act {c.hidden_act!r} is not supported (silu is)")
    if mt == "qwen2":
        if c.use_sliding_window:
            raise _refuse(path, f"use_sliding_window = true (sliding-window attention, window {c.sliding_window}) "
                                "is not supported")
        layer_types = list(getattr(c, "layer_types", None) or [])
        if set(layer_types) - {"full_attention"}:
            raise _refuse(path, f"layer_types {layer_types} is not supported (full_attention only)")
        qkv_bias, o_bias, mlp_bias = True, False, False  # Qwen2's attention: q, k, v biases, none on o
    else:
        qkv_bias = o_bias = bool(c.attention_bias)
        mlp_bias = bool(c.mlp_bias)
    theta, scaling = _rope(path, raw, c, _version(tf) >= (5, 0))
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    if kv_heads < 1 or heads % kv_heads:
        raise _refuse(path, f"num_attention_heads = {heads} is not a multiple of num_key_value_heads = {kv_heads}")
    if head_dim % 2:
        raise _refuse(path, f"head_dim = {head_dim} is odd (rotary embeddings rotate pairs)")
    return LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       intermediate_size=c.intermediate_size, rope_theta=theta, rms_norm_eps=c.rms_norm_eps,
                       rope_scaling=scaling, qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias,
                       tie_word_embeddings=bool(c.tie_word_embeddings))


def _rope(path, raw: dict, c, tf5: bool) -> tuple[float, RopeScaling | None]:
    """The rotary base and scaling of config ``c`` as the installed transformers keeps them: 5 in
    ``rope_parameters`` (``rope_theta`` included), 4.57 in ``rope_theta`` and ``rope_scaling``."""
    if tf5:
        params = dict(c.rope_parameters or {})
    else:
        if "rope_parameters" in raw:  # 4.57 ignores it: its model would run with the default base
            raise _refuse(path, f"rope_parameters {raw['rope_parameters']!r} is transformers 5's layout, which the "
                                f"installed transformers 4 ignores (pip install -U transformers)")
        params = dict(c.rope_scaling or {})
        params["rope_theta"] = c.rope_theta
        if getattr(c, "partial_rotary_factor", None) is not None:
            params.setdefault("partial_rotary_factor", c.partial_rotary_factor)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if not isinstance(params.get("rope_theta"), (int, float)):
        raise _refuse(path, f"rope_theta {params.get('rope_theta')!r} is not a number")
    theta = float(params.pop("rope_theta"))
    partial = params.pop("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise _refuse(path, f"partial_rotary_factor = {partial!r} is not supported (1.0 is)")
    if rope_type not in _ROPE_FIELDS:
        raise _refuse(path, f"rope type {rope_type!r} is not supported (default, linear and llama3 are)")
    fields = _ROPE_FIELDS[rope_type]
    for key, value in params.items():
        if key not in fields and value is not None:
            raise _refuse(path, f"rope setting {key} = {value!r} is not read for rope type {rope_type!r}")
    missing = [k for k in fields if not isinstance(params.get(k), (int, float))]
    if missing:
        raise _refuse(path, f"rope type {rope_type!r} needs {', '.join(missing)} (got {params!r})")
    return theta, RopeScaling(rope_type, *(params[k] for k in fields)) if fields else None
