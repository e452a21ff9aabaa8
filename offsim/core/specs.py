"""Model, hardware and workload specifications: frozen dataclasses with explicit ``from_dict``/``to_dict``.

ModelSpec comes from a transformers config (object, dict or ``config.json`` path) -- never the hub -- or a preset.
HardwareSpec comes from a preset or a hardware-profile JSON, the schema ``offexec profile`` writes
(``HARDWARE_SCHEMA``); a preset is such a profile shipped with offsim (``offsim/core/presets/hardware/<name>.json``,
whose ``provenance`` map gives each constant's source). Workload is prompt/generation length and the block shape.

Byte accounting (docs/architecture.md §3): a layer's weights are laid out as one flat fp16 buffer (see ``layer_tensors``), so a
"slice" of a layer's weights is a byte range of that buffer; KV cache bytes per token per layer are
``2 (K and V) * n_kv_heads * head_dim * dtype_bytes`` (= 4·h bytes for OPT in fp16, as FlexGen counts).
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from offsim.core.errors import OffsimError

GiB = 1 << 30
GB = 10**9


# ----------------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------------
# the largest size of each model field offsim takes: far past any real model (Llama-3-405B: 126 layers, d_model
# 16,384, 128 heads, ffn 53,248, vocabulary 128,256, 131,072 positions), so only a typo is refused
MODEL_SIZE_LIMITS = {"num_layers": 10_000, "d_model": 1 << 20, "num_heads": 1 << 14, "num_kv_heads": 1 << 14,
                     "head_dim": 1 << 14, "ffn_dim": 1 << 22, "vocab_size": 1 << 24, "max_positions": 1 << 24,
                     "dtype_bytes": 8}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, as far as cost and layout go. Derived sizes are methods, in bytes."""

    name: str
    family: str  # "opt" (LayerNorm, learned positions, ReLU FFN) or "llama" (RMSNorm, RoPE, SwiGLU, GQA)
    num_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    max_positions: int
    dtype_bytes: int = 2  # fp16
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if self.family not in ("opt", "llama"):
            raise OffsimError(f"model family {self.family!r} is not supported; valid: 'opt', 'llama'")
        for f in ("num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "ffn_dim", "vocab_size",
                  "max_positions", "dtype_bytes"):
            if int(getattr(self, f)) <= 0:
                raise OffsimError(f"model {self.name}: {f} must be positive, got {getattr(self, f)}")
            if getattr(self, f) > MODEL_SIZE_LIMITS[f]:  # (a typo's 10**9 layers ran for minutes, 10**400 overflowed)
                v = str(getattr(self, f))
                raise OffsimError(f"model {self.name}: {f} {v if len(v) < 16 else v[:6] + f'... ({len(v)} digits)'} "
                                  f"is more than offsim models (at most {MODEL_SIZE_LIMITS[f]:,})")
        if self.dtype_bytes not in (2, 4):
            raise OffsimError(f"model {self.name}: dtype_bytes must be 2 (fp16, bf16) or 4 (fp32), got "
                              f"{self.dtype_bytes}")
        if self.num_heads % self.num_kv_heads:
            raise OffsimError(f"model {self.name}: num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                              f"({self.num_kv_heads})")

    # -- layout -----------------------------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of one decoder layer's weights, in the order of its flat buffer. Shapes are [out, in]."""
        h, q, kv, f = self.d_model, self.q_dim, self.kv_dim, self.ffn_dim
        if self.family == "opt":
            return [("q_proj.weight", (q, h)), ("q_proj.bias", (q,)),
                    ("k_proj.weight", (kv, h)), ("k_proj.bias", (kv,)),
                    ("v_proj.weight", (kv, h)), ("v_proj.bias", (kv,)),
                    ("out_proj.weight", (h, q)), ("out_proj.bias", (h,)),
                    ("self_attn_layer_norm.weight", (h,)), ("self_attn_layer_norm.bias", (h,)),
                    ("fc1.weight", (f, h)), ("fc1.bias", (f,)),
                    ("fc2.weight", (h, f)), ("fc2.bias", (h,)),
                    ("final_layer_norm.weight", (h,)), ("final_layer_norm.bias", (h,))]
        return [("q_proj.weight", (q, h)), ("k_proj.weight", (kv, h)), ("v_proj.weight", (kv, h)),
                ("o_proj.weight", (h, q)), ("input_layernorm.weight", (h,)),
                ("gate_proj.weight", (f, h)), ("up_proj.weight", (f, h)), ("down_proj.weight", (h, f)),
                ("post_attention_layernorm.weight", (h,))]

    def layer_weight_bytes(self) -> int:
        """Bytes of one decoder layer's weights (all tensors of ``layer_tensors``)."""
        return sum(math.prod(s) for _, s in self.layer_tensors()) * self.dtype_bytes

    def embedding_bytes(self) -> int:
        """Bytes outside the decoder layers: token (+ position) embeddings, final norm, LM head if untied."""
        h = self.d_model
        n = self.vocab_size * h + h * (2 if self.family == "opt" else 1)  # embeddings + final norm (w, b for OPT)
        if self.family == "opt":
            n += (self.max_positions + 2) * h  # learned positions; OPT offsets them by 2
        if not self.tie_word_embeddings:
            n += self.vocab_size * h
        return n * self.dtype_bytes

    def weight_bytes(self) -> int:
        """All weights, bytes."""
        return self.num_layers * self.layer_weight_bytes() + self.embedding_bytes()

    def flexgen_model_bytes(self) -> int:
        """Model size exactly as FlexGen accounts it (flexgen/opt_config.py ``model_bytes``), for comparison only:
        it drops some biases and the position table, so it differs from ``weight_bytes`` by < 0.1 %."""
        h = self.d_model
        per_layer = h * (3 * h + 1) + h * (h + 1) + h * (4 * h + 1) + h * 4 * (h + 1) + h * 4
        return 2 * (self.num_layers * per_layer + self.vocab_size * (h + 1))

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes of one token in one layer: K and V, n_kv_heads · head_dim each."""
        return 2 * self.kv_dim * self.dtype_bytes  # 2: K and V

    def kv_bytes(self, num_seqs: int, num_tokens: int, num_layers: int | None = None) -> int:
        """KV-cache bytes for ``num_seqs`` sequences of ``num_tokens`` tokens over ``num_layers`` (default: all)."""
        layers = self.num_layers if num_layers is None else num_layers
        return num_seqs * num_tokens * layers * self.kv_bytes_per_token()

    def hidden_bytes(self, num_tokens: int) -> int:
        """Bytes of the hidden state (activations between layers) for ``num_tokens`` tokens."""
        return num_tokens * self.d_model * self.dtype_bytes

    # -- construction -----------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelSpec":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise OffsimError(f"model spec has unknown fields {sorted(unknown)}; valid: {sorted(names)}")
        try:
            return cls(**d)
        except TypeError as e:
            raise OffsimError(f"model spec is incomplete: {e}") from None

    @classmethod
    def from_hf_config(cls, config: Any, name: str | None = None) -> "ModelSpec":
        """From a transformers ``PretrainedConfig``, its dict, or a path to a ``config.json`` (no hub access)."""
        if isinstance(config, (str, Path)):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            try:
                cfg = json.loads(path.read_text())
            except UnicodeDecodeError:
                raise OffsimError(f"model config {path} is not text (not UTF-8): give a transformers config.json") \
                    from None
            except (OSError, json.JSONDecodeError) as e:
                raise OffsimError(f"cannot read model config {path}: {e}") from None
            # a checkpoint folder's config.json is named for its folder (transformers' layout); any other file for
            # itself, so that two configs in one folder keep their own names
            name = name or (path.parent.name if path.name == "config.json" else path.stem)
        elif isinstance(config, Mapping):
            cfg = dict(config)
        elif hasattr(config, "to_dict"):
            cfg = config.to_dict()
        else:
            raise OffsimError(f"expected a transformers config, dict or config.json path, got {type(config).__name__}")
        if not isinstance(cfg, Mapping):
            raise OffsimError(f"model config must be a JSON object (a transformers config.json), got a JSON "
                              f"{'array' if isinstance(cfg, list) else type(cfg).__name__}")
        mtype = cfg.get("model_type")
        _check_hf_numbers(cfg, mtype)
        tie = cfg.get("tie_word_embeddings")
        if tie is not None and not isinstance(tie, bool):
            raise OffsimError(f"model config: tie_word_embeddings must be true or false, got {tie!r}")
        try:
            if mtype == "opt":
                h = cfg["hidden_size"]
                if cfg.get("word_embed_proj_dim", h) != h or not cfg.get("do_layer_norm_before", True):
                    raise OffsimError("OPT variants with a projected embedding or post-layer-norm (opt-350m) are not "
                                      "supported")
                if cfg.get("activation_function", "relu") != "relu":
                    raise OffsimError(f"OPT activation {cfg['activation_function']!r} not supported; valid: 'relu'")
                if cfg.get("enable_bias", True) is not True:
                    raise OffsimError("OPT without biases (enable_bias false) is not supported: the layers have them")
                if cfg.get("layer_norm_elementwise_affine", True) is not True:
                    raise OffsimError("OPT with layer_norm_elementwise_affine false is not supported: the layer norms "
                                      "here have weights and biases")
                heads = cfg["num_attention_heads"]
                return cls(name=name or cfg.get("_name_or_path") or "opt", family="opt",
                           num_layers=cfg["num_hidden_layers"], d_model=h, num_heads=heads, num_kv_heads=heads,
                           head_dim=h // heads, ffn_dim=cfg["ffn_dim"], vocab_size=cfg["vocab_size"],
                           max_positions=cfg["max_position_embeddings"], norm_eps=1e-5,
                           tie_word_embeddings=cfg.get("tie_word_embeddings", True))
            if mtype == "llama":
                rope_theta = _llama_checked(cfg)
                h = cfg["hidden_size"]
                heads = cfg["num_attention_heads"]
                return cls(name=name or cfg.get("_name_or_path") or "llama", family="llama",
                           num_layers=cfg["num_hidden_layers"], d_model=h, num_heads=heads,
                           num_kv_heads=cfg.get("num_key_value_heads") or heads,
                           head_dim=cfg.get("head_dim") or h // heads, ffn_dim=cfg["intermediate_size"],
                           vocab_size=cfg["vocab_size"], max_positions=cfg["max_position_embeddings"],
                           norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=rope_theta,
                           tie_word_embeddings=cfg.get("tie_word_embeddings", False))
        except KeyError as e:
            raise OffsimError(f"model config lacks field {e.args[0]!r} (model_type {mtype!r})") from None
        raise OffsimError(f"model_type {mtype!r} is not supported; valid: 'opt', 'llama'")

    def to_hf_config_dict(self) -> dict:
        """The transformers config dict of this model (``OPTConfig(**d)`` / ``LlamaConfig(**d)``)."""
        return _hf_config(self.family, self.num_layers, self.d_model, self.num_heads, self.num_kv_heads,
                          self.ffn_dim, self.vocab_size, self.max_positions, self.rope_theta, self.norm_eps,
                          self.tie_word_embeddings, self.head_dim)


def _llama_checked(cfg: Mapping[str, Any]) -> float:
    """A Llama config's RoPE base, after refusing what the layer math here does not do (so that a config written for
    a variant is an error, not wrong tokens): RoPE other than the default (scaled: linear, dynamic, yarn, llama3),
    biases on the attention or MLP projections, an activation other than SiLU. transformers 5 writes the RoPE base
    and type into ``rope_parameters``; older versions wrote ``rope_theta`` and ``rope_scaling`` at the top."""
    rp = cfg.get("rope_parameters") or {}
    if not isinstance(rp, Mapping):
        raise OffsimError(f"model config field 'rope_parameters' must be an object, got {rp!r}")
    scaling = cfg.get("rope_scaling") or {}
    # each field on its own: a config may carry both (a default rope_parameters beside a linear rope_scaling, which
    # transformers reads as linear)
    kinds = [rp.get("rope_type") or rp.get("type"),
             scaling.get("rope_type") or scaling.get("type") if isinstance(scaling, Mapping) else scaling]
    for kind in kinds:
        if kind and kind != "default":
            raise OffsimError(f"Llama RoPE type {kind!r} is not supported; valid: 'default' (no rope scaling)")
    for f in ("attention_bias", "mlp_bias"):
        if cfg.get(f):
            raise OffsimError(f"Llama with {f} true is not supported: the projections here have no biases")
    if cfg.get("hidden_act", "silu") != "silu":
        raise OffsimError(f"Llama activation {cfg['hidden_act']!r} is not supported; valid: 'silu'")
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise OffsimError(f"model config field 'rope_theta' must be a positive number, got {theta!r}")
    return float(theta)


# The integer fields of a transformers config that ``from_hf_config`` reads, per model_type; the optional ones may
# be absent or null (then derived: num_key_value_heads = num_attention_heads, head_dim = hidden_size / heads).
_HF_INT_FIELDS = {"opt": ("num_hidden_layers", "hidden_size", "num_attention_heads", "ffn_dim", "vocab_size",
                          "max_position_embeddings"),
                  "llama": ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                            "vocab_size", "max_position_embeddings")}
_HF_OPTIONAL_INT_FIELDS = ("num_key_value_heads", "head_dim")
_HF_OPTIONAL_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")


def _check_hf_numbers(cfg: Mapping[str, Any], mtype: Any) -> None:
    """Refuse a config whose sizes are missing, not positive integers, or inconsistent, naming the field: a string
    or a float where a size belongs would otherwise surface as a TypeError deep in the cost model."""
    if mtype not in _HF_INT_FIELDS:
        return  # from_hf_config names the supported model types
    for f in _HF_INT_FIELDS[mtype] + _HF_OPTIONAL_INT_FIELDS:
        if f not in cfg or (cfg[f] is None and f in _HF_OPTIONAL_INT_FIELDS):
            if f in _HF_OPTIONAL_INT_FIELDS:
                continue
            raise OffsimError(f"model config lacks field {f!r} (model_type {mtype!r})")
        v = cfg[f]
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise OffsimError(f"model config field {f!r} must be a positive integer, got {v!r}")
    for f in _HF_OPTIONAL_FLOAT_FIELDS:
        v = cfg.get(f)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise OffsimError(f"model config field {f!r} must be a positive number, got {v!r}")
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if h % heads and not (mtype == "llama" and cfg.get("head_dim")):
        raise OffsimError(f"model config: hidden_size ({h}) must be divisible by num_attention_heads ({heads}), "
                          f"the head dimension being hidden_size / num_attention_heads")


def _hf_config(family, layers, h, heads, kv_heads, ffn, vocab, max_pos, rope_theta=10000.0, eps=None,
               tie=None, head_dim=None) -> dict:
    if family == "opt":
        return {"model_type": "opt", "num_hidden_layers": layers, "hidden_size": h, "num_attention_heads": heads,
                "ffn_dim": ffn, "vocab_size": vocab, "max_position_embeddings": max_pos,
                "word_embed_proj_dim": h, "do_layer_norm_before": True, "activation_function": "relu",
                "tie_word_embeddings": True if tie is None else tie, "enable_bias": True}
    d = {"model_type": "llama", "num_hidden_layers": layers, "hidden_size": h, "num_attention_heads": heads,
         "num_key_value_heads": kv_heads, "intermediate_size": ffn, "vocab_size": vocab,
         "max_position_embeddings": max_pos, "rope_theta": rope_theta, "rms_norm_eps": 1e-5 if eps is None else eps,
         "tie_word_embeddings": False if tie is None else tie, "hidden_act": "silu"}
    if head_dim is not None and head_dim != h // heads:
        d["head_dim"] = head_dim
    return d


# Preset configs are transformers config dicts (public model cards' config.json values) and go through the same
# ``from_hf_config`` path as a user's config.
MODEL_PRESETS: dict[str, dict] = {
    "opt-125m": _hf_config("opt", 12, 768, 12, 12, 3072, 50272, 2048),
    "opt-1.3b": _hf_config("opt", 24, 2048, 32, 32, 8192, 50272, 2048),
    "opt-6.7b": _hf_config("opt", 32, 4096, 32, 32, 16384, 50272, 2048),
    "opt-13b": _hf_config("opt", 40, 5120, 40, 40, 20480, 50272, 2048),
    "opt-30b": _hf_config("opt", 48, 7168, 56, 56, 28672, 50272, 2048),
    "opt-66b": _hf_config("opt", 64, 9216, 72, 72, 36864, 50272, 2048),
    "opt-175b": _hf_config("opt", 96, 12288, 96, 96, 49152, 50272, 2048),
    "llama-2-7b": _hf_config("llama", 32, 4096, 32, 32, 11008, 32000, 4096, 10000.0, 1e-5),
    "llama-2-13b": _hf_config("llama", 40, 5120, 40, 40, 13824, 32000, 4096, 10000.0, 1e-5),
    "llama-2-70b": _hf_config("llama", 80, 8192, 64, 8, 28672, 32000, 4096, 10000.0, 1e-5),
    "llama-3-8b": _hf_config("llama", 32, 4096, 32, 8, 14336, 128256, 8192, 500000.0, 1e-5),
    "llama-3-70b": _hf_config("llama", 80, 8192, 64, 8, 28672, 128256, 8192, 500000.0, 1e-5),
}


def get_model(name_or_path: str | Path) -> ModelSpec:
    """A preset by name, or a ``config.json`` (or a directory holding one)."""
    key = str(name_or_path)
    if key.lower() in MODEL_PRESETS:
        return ModelSpec.from_hf_config(MODEL_PRESETS[key.lower()], name=key.lower())
    p = Path(key)
    if p.suffix == ".json" or p.is_dir():
        f = p if p.suffix == ".json" else p / "config.json"
        if not f.exists():
            raise OffsimError(f"model config {f} does not exist" + (f" (the directory {p} holds no config.json)"
                                                                    if p.is_dir() else ""))
        return ModelSpec.from_hf_config(p)
    raise OffsimError(f"unknown model {key!r}; valid presets: {', '.join(MODEL_PRESETS)} "
                      "(or a path to a transformers config.json)")


# ----------------------------------------------------------------------------------------------------------------
# Compression (FlexGen's 4-bit group-wise quantization and sparse attention)
# ----------------------------------------------------------------------------------------------------------------
QUANT_BITS = 4  # bits per element of FlexGen's compressed tensors (CompressionConfig(num_bits=4))
QUANT_GROUP_SIZE = 64  # elements per group sharing one min and one step (CompressionConfig(group_size=64))
QUANT_SCALE_BYTES = 2  # the per-group min and step (the scale) are fp16 each
# Which dim a tensor is grouped along (FlexGen's ``group_dim``): a weight [out, in] along dim 0, its output channel
# (FlexGen's comp_weight_config, group_dim=0 of torch's Linear layout); the KV cache along the head dimension D
# (comp_cache_config, group_dim=2 of its [s, b·heads, D] layout): a group is 64 consecutive elements of one token's
# K (or V) of one head. 1-D tensors (biases, norms) stay fp16, as FlexGen's ``init_weight_list`` keeps them.
WEIGHT_GROUP_DIM = 0
COMPRESSION_KEYS = ("compress_weight", "compress_cache", "sparse_attention")  # the settings that carry it


# (step, layer, GPU batch) positions a plan may have: its ops are ~10 per position, ~120 bytes each in memory, so
# this is plans of ~40 million ops and ~5 GB (OPT-175B, FlexGen's 32 x 8 at gen 32: 0.1 million positions)
MAX_PLAN_POSITIONS = 4_000_000


def check_plan_size(model: "ModelSpec", wl: "Workload") -> None:
    """Refuse, from arithmetic, a workload whose plan would not fit in this machine's memory or build in minutes:
    gen-len x (layers + 2) x GPU batches (step, layer, batch) positions past ``MAX_PLAN_POSITIONS`` (10**12 GPU
    batches ended in a MemoryError; 10**5 built for 100 s into 6.4 GB)."""
    n = wl.gen_len * (model.num_layers + 2) * wl.num_gpu_batches
    if n > MAX_PLAN_POSITIONS:
        raise OffsimError(f"gen-len {wl.gen_len} x {model.num_layers + 2} layers (the embedding and head included) x "
                          f"{wl.num_gpu_batches:,} GPU batches is {n:,} (step, layer, batch) positions, more than one "
                          f"plan holds (at most {MAX_PLAN_POSITIONS:,}): use fewer, larger GPU batches or a shorter "
                          "generation")


def check_positions(model: "ModelSpec", wl: "Workload") -> None:
    """Refuse a workload whose longest sequence (prompt-len + gen-len - 1 positions) the model has no positions
    for -- before any memory arithmetic, whose shortfall would say nothing about the real cause."""
    if wl.max_len > model.max_positions:
        raise OffsimError(f"prompt-len + gen-len - 1 = {wl.max_len} exceeds {model.name}'s {model.max_positions} "
                          "positions")


@dataclass(frozen=True)
class Compression:
    """The approximations a plan runs with, as FlexGen names them: ``weight`` (``--compress-weight``: decoder weight
    matrices stored 4-bit group-wise, dequantized to fp16 before each compute), ``cache`` (``--compress-cache``: the
    KV cache stored 4-bit, quantized on store and dequantized before attention) and ``sparse_attention`` (FlexGen's
    ``--attn-sparsity``: in decode each query keeps the top fraction of K positions and only those V rows are loaded
    and multiplied; 1.0 = dense). Policies carry these as their settings ``compress_weight``, ``compress_cache``
    and ``sparse_attention`` (``COMPRESSION_KEYS``); the plan's settings are the contract (``from_settings``)."""

    weight: bool = False
    cache: bool = False
    sparse_attention: float = 1.0

    def __post_init__(self):
        for f in ("weight", "cache"):
            if not isinstance(getattr(self, f), bool):
                raise OffsimError(f"compress_{f} must be true or false, got {getattr(self, f)!r}")
        f = self.sparse_attention
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise OffsimError(f"sparse_attention must be a fraction in (0, 1] (1: dense attention), got {f!r}")

    def check_cpu_attention(self, cpu_attention: bool) -> None:
        """Refuse CPU attention with compressed weights or cache, as FlexGen does (its compressed mode turns CPU
        attention off: dequantizing on the host costs more than the delegation saves)."""
        if cpu_attention and (self.weight or self.cache):
            raise OffsimError("CPU attention cannot be combined with --compress-weight or --compress-cache (FlexGen "
                              "turns it off with compression); drop one of them")

    @property
    def any(self) -> bool:
        """Whether anything differs from dense fp16."""
        return self.weight or self.cache or self.sparse_attention < 1

    def describe(self) -> str:
        """A short label: 'fp16', '4-bit weights', '4-bit cache', '4-bit weights+cache', with ', sparse 0.1'."""
        parts = [p for p, on in (("weights", self.weight), ("cache", self.cache)) if on]
        out = "4-bit " + "+".join(parts) if parts else "fp16"
        return out + (f", sparse {self.sparse_attention:g}" if self.sparse_attention < 1 else "")

    def settings(self) -> dict:
        """As policy settings (``COMPRESSION_KEYS``)."""
        return {"compress_weight": self.weight, "compress_cache": self.cache,
                "sparse_attention": float(self.sparse_attention)}

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any] | Any | None) -> "Compression":
        """From a plan's (or a settings object's) ``compress_weight``, ``compress_cache``, ``sparse_attention``;
        absent keys are off (plans of policies that do not model compression, and plans from before it)."""
        if settings is None:
            return NO_COMPRESSION
        get = settings.get if isinstance(settings, Mapping) else (lambda k, d: getattr(settings, k, d))
        c = cls(get("compress_weight", False), get("compress_cache", False), get("sparse_attention", 1.0))
        return NO_COMPRESSION if c == NO_COMPRESSION else c


NO_COMPRESSION = Compression()


# ----------------------------------------------------------------------------------------------------------------
# Hardware
# ----------------------------------------------------------------------------------------------------------------
HARDWARE_SCHEMA = "offsim.hardware/1"
# see HardwareSpec.op_times
OP_TABLE_MODES = ("graph", "eager", "tokens", "graph_tokens", "capture", "cpu", "attn", "copy", "issue", "quant",
                  "clock")

Curve = tuple[tuple[float, float], ...]  # (x, y) points, x increasing; interpolated in log(x), clamped at the ends


def _op_times_from_json(v: Any, where: str) -> tuple:
    """``op_times`` rows from JSON lists, each [key, mode, part, [[x, y], ...]]; anything else is refused by name."""
    if not isinstance(v, (list, tuple)):
        raise OffsimError(f"{where}: op_times must be a list of rows [layer key, mode, part, [[x, seconds], ...]], "
                          f"got {str(v)[:60]}")
    rows = []
    for r in v:
        ok = isinstance(r, (list, tuple)) and len(r) == 4 and all(isinstance(x, str) for x in r[:3]) \
            and isinstance(r[3], (list, tuple)) and all(
            isinstance(q, (list, tuple)) and len(q) == 2 and all(isinstance(z, (int, float)) for z in q)
            for q in r[3])
        if not ok:
            raise OffsimError(f"{where}: op_times rows must be [layer key, mode (one of {', '.join(OP_TABLE_MODES)}), "
                              f"part, [[x, seconds], ...]]; got {str(r)[:120]}")
        rows.append((str(r[0]), str(r[1]), str(r[2]), tuple((float(a), float(b)) for a, b in r[3])))
    return tuple(rows)


def layer_key(model: ModelSpec) -> str:
    """What fixes a decoder layer's kernels, as the key of its op-table rows (``HardwareSpec.op_times``): models
    that share it (the same family and sizes, any depth or vocabulary) share the rows."""
    m = model
    return (f"{m.family}/h{m.d_model}/q{m.num_heads}/kv{m.num_kv_heads}/d{m.head_dim}/f{m.ffn_dim}/"
            f"b{m.dtype_bytes}")


def is_finite_number(v) -> bool:
    """A real number that is not NaN or infinite (JSON's Infinity and NaN parse as floats; booleans are not numbers
    here)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


MAX_FLOP_EFFICIENCY = 2.0  # the most a profile's efficiency curves may claim of its peak FLOP/s (HardwareSpec)


@dataclass(frozen=True)
class HardwareSpec:
    """One GPU, its PCIe link, the host and a disk. Every rate is in bytes/s or FLOP/s, every size in bytes.

    Curves are ((x, y), ...) with x increasing, interpolated linearly in log(x) by the cost model:
    - ``gemm_efficiency``: x = tokens (rows of the GEMM), y = achieved / peak FLOP/s;
    - ``attn_prefill_efficiency``: x = context tokens, y = achieved / peak FLOP/s of causal attention;
    - ``attn_decode_efficiency``: x = context tokens, y = achieved / HBM bytes/s of reading the KV cache;
    - ``h2d_pinned`` ... ``d2h_pageable``: x = transfer bytes, y = bytes/s of one copy of that size.
    """

    name: str
    gpu_mem_bytes: int
    gpu_peak_flops: float
    gpu_hbm_bytes_per_s: float
    gemm_efficiency: Curve
    attn_prefill_efficiency: Curve
    attn_decode_efficiency: Curve
    h2d_pinned: Curve
    d2h_pinned: Curve
    h2d_pageable: Curve
    d2h_pageable: Curve
    duplex_fraction: float  # share of its own bandwidth each direction keeps while the other direction is busy
    cpu_mem_bytes: int
    cpu_attention_flops: float  # FLOP/s of attention on the host CPU (FlexGen's CPU delegation)
    disk_bytes: int
    disk_read_bytes_per_s: float  # cold, past the page cache (O_DIRECT): what the executor's default disk tier gets
    disk_write_bytes_per_s: float
    link_latency_s: float = 0.0  # fixed cost of one copy, on top of bytes / bandwidth
    kernel_overhead_s: float = 0.0  # fixed cost of one compute op (launches, norms, residual adds)
    # host time the runtime spends issuing one op, in plan order on one thread (0: an ideal runtime). A Python
    # executor spends ~1 ms per decoder-layer op (~30 kernel launches): with small batches that, not the GPU, sets
    # the pace. `experiments/validation/calibrate_issue.py` measures it for offexec.
    issue_compute_s: float = 0.0
    issue_copy_s: float = 0.0
    # the same for a decode op replayed as a CUDA graph (offexec/graphs.py): a few copies and one launch; 0: not
    # measured (such ops are then priced at issue_compute_s)
    issue_graph_s: float = 0.0
    # the page-cached disk tier (a plan with ``disk_cached``): reads of files that were just written and still sit in
    # the page cache, writes into it (offexec profile, DiskTier(cached=True)); 0 = not measured. It prices a cached
    # plan only while its disk files fit in free host memory: past that the kernel evicts and reads hit the disk.
    disk_cached_read_bytes_per_s: float = 0.0
    disk_cached_write_bytes_per_s: float = 0.0
    # op tables (``offexec profile --ops``): seconds of a compute op as the executor runs it, measured per model
    # layer shape. Rows (layer_key, mode, part, curve): mode 'graph' / 'eager' (a decode op replayed as a CUDA graph
    # or issued kernel by kernel; x = sequences), 'tokens' (prefill or recompute, eager; x = tokens),
    # 'graph_tokens' (TightLLM's short recomputes replayed as CUDA graphs; x = sequences x query tokens),
    # 'capture' (a graphed op the first time it runs: its static body eagerly, then its capture; part 'first': the
    # run's first such op; x = sequences), 'issue' (part KIND_TENSOR, e.g. 'h2d_kv': the host time offexec spends
    # issuing one such copy, by bytes x), 'cpu' (part 'attn':
    # a CPU-attention op's fixed cost; x = sequences; part 'attn_flops': its FLOP/s), 'attn' (part 'prefill' or
    # 'recompute': causal GPU attention's efficiency, y = achieved / peak FLOP/s, by context x, with this model's
    # heads, GQA and the executor's KV layout), 'copy' (part 'd2h_qkv' or 'h2d_attn_out': CPU attention's small
    # copies, by bytes x; part 'store_flexgen:fp16' / ':4bit': FlexGen's own store of a prefill's K and V into its
    # fresh unpinned host cache, by bytes stored x, what flexgen-ref's relayed KV stores pay), 'quant' (part
    # 'dequant_flexgen:weight' / ':cache': FlexGen's own 4-bit decompress on the GPU, by fp16 bytes x; what
    # flexgen-ref's compressed plans pay), 'clock' (part 'sustained': the share of its burst rate this layer shape's
    # FFN GEMM holds under seconds of load, y, at its tokens x: the model's own ``sustained_compute_fraction``; part
    # 'held': that share in each window of the probe, by seconds under load x, not read yet). Where a row exists the cost model reads it instead of the analytical
    # GEMM, elementwise and overhead terms or the model-agnostic curves (costmodel.compute_seconds); () = none.
    op_times: tuple = ()
    # compute-bound GEMM rate held under seconds of back-to-back load (a prefill) over the rate of a burst after
    # idle: the clocks drop under the power cap (offexec profile --ops; 1: not measured). The cost model divides
    # compute-bound ops (many tokens, past the ridge point) by it
    sustained_compute_fraction: float = 1.0
    # fp16 bytes per second that the GPU dequantizes from (or quantizes into) FlexGen's 4-bit group-wise format
    # (costmodel.quant_seconds): the rate of the unpack-scale-shift passes, which are memory-bound. 0: not measured,
    # then gpu_hbm_bytes_per_s / QUANT_HBM_PASSES (costmodel); the presets give it with that source, and a profile
    # from ``offexec profile`` may measure it
    quant_bytes_per_s: float = 0.0
    # fp16 bytes per second the GPU quantizes into that format on the KV store (the new tokens' K and V: the
    # executor's fused store kernel, or PyTorch chunks, differs in speed from the fused dequantize; ``offexec profile``
    # measures it). 0: not measured, then the store is priced at quant_bytes_per_s like every other pass (so profiles
    # without the key predict as before)
    quant_store_bytes_per_s: float = 0.0
    # fp16 bytes per second the GPU dequantizes compressed *weights* into (one large matrix per call: the fused
    # kernel runs near HBM speed, ~3x the KV cache's many small vectors on the H200; ``offexec profile`` measures
    # both). 0: not measured, then weights are priced at quant_bytes_per_s like the cache (profiles without the key
    # predict as before)
    quant_weight_bytes_per_s: float = 0.0
    source: str = ""  # provenance: where the numbers come from
    # bytes/s of one GPU-to-GPU copy (pipeline parallelism: hidden states between stages; NVLink or PCIe peer).
    # 0: not measured, then the pinned host-to-device link's best rate (``costmodel.gpu_link_bytes_per_s``): a
    # PCIe peer copy through the root complex runs at about one PCIe link's rate
    gpu_link_bytes_per_s: float = 0.0
    # each GPU's share of its pinned host link rate while every GPU of the host copies from host memory at once
    # (``offexec profile`` on a host with several GPUs); 1: independent links (or not measured). A pipeline's
    # stages stream their weights at the same time, so the simulator prices a multi-GPU plan's copies at this share
    link_concurrent_fraction: float = 1.0
    # bytes/s between two hosts (a pipeline over several nodes, ``gpus_per_node``: hidden states cross it between
    # stages on different nodes, GPU -> host -> network -> host -> GPU, ``costmodel.network_p2p_seconds``).
    # 0: not given, then a plan over several nodes is refused
    network_bytes_per_s: float = 0.0
    # a copy between unpinned host memory and the GPU that the caller stages through a pinned copy of its own
    # (FlexGen's ``general_copy``: ``src.pin_memory()``, then the transfer; a D2H into a pinned buffer, then a copy
    # out): x = bytes, y = bytes/s of one such copy. A plan with ``pageable_copy`` 'relay' prices its unpinned copies
    # with these; () not measured, then at the pageable curves (a plain copy from pageable memory)
    h2d_relay: Curve = ()
    d2h_relay: Curve = ()
    # one request of offexec's O_DIRECT disk tier by its size, as a run makes it (``offexec profile
    # --disk-ops-only``): x = bytes, y = seconds of the request -- its worker threads and system calls, the bounce
    # buffer and the read-modify-write of partial blocks, the device's own latency. A run's small KV stores (a
    # token's slab, tens of KB) cost far more than their bytes at the rate (0.86 ms measured against 0.02 priced in
    # calibration case opt-30b_flexgen_b12_p256_g32). () not measured: bytes at the rate alone
    disk_read_op: Curve = ()
    disk_write_op: Curve = ()

    def __post_init__(self):
        number = is_finite_number
        for f in ("gpu_mem_bytes", "gpu_peak_flops", "gpu_hbm_bytes_per_s", "cpu_mem_bytes", "cpu_attention_flops",
                  "disk_read_bytes_per_s", "disk_write_bytes_per_s"):
            v = getattr(self, f)
            if not number(v) or not v > 0:
                raise OffsimError(f"hardware {self.name}: {f} must be a finite positive number, got {v!r}")
        for f in ("disk_cached_read_bytes_per_s", "disk_cached_write_bytes_per_s", "quant_bytes_per_s",
                  "quant_store_bytes_per_s", "quant_weight_bytes_per_s", "gpu_link_bytes_per_s",
                  "network_bytes_per_s"):
            v = getattr(self, f)
            if not number(v) or not v >= 0:
                raise OffsimError(f"hardware {self.name}: {f} must be a finite non-negative number (0: not "
                                  f"measured), got {v!r}")
        # fixed costs in seconds (0: none, an ideal runtime) and the disk's size in bytes (0: no disk tier)
        for f in ("link_latency_s", "kernel_overhead_s", "issue_compute_s", "issue_copy_s", "issue_graph_s",
                  "disk_bytes"):
            v = getattr(self, f)
            if not number(v) or not v >= 0:
                raise OffsimError(f"hardware {self.name}: {f} must be a finite non-negative number, got {v!r}")
        if not 0 < self.sustained_compute_fraction <= 1:
            raise OffsimError(f"hardware {self.name}: sustained_compute_fraction must be in (0, 1], got "
                              f"{self.sustained_compute_fraction}")
        if not 0 < self.link_concurrent_fraction <= 1:
            raise OffsimError(f"hardware {self.name}: link_concurrent_fraction must be in (0, 1], got "
                              f"{self.link_concurrent_fraction}")
        if not 0 < self.duplex_fraction <= 1:
            raise OffsimError(f"hardware {self.name}: duplex_fraction must be in (0, 1], got {self.duplex_fraction}")
        for row in self.op_times:
            if (len(row) != 4 or not isinstance(row[0], str) or row[1] not in OP_TABLE_MODES
                    or not isinstance(row[2], str) or not row[3]
                    or any(len(p) != 2 or not p[0] > 0 or not p[1] > 0 or not all(map(math.isfinite, p))
                           for p in row[3])
                    or any(a[0] >= b[0] for a, b in zip(row[3], row[3][1:]))):
                raise OffsimError(f"hardware {self.name}: op_times rows must be [layer key, mode (one of "
                                  f"{', '.join(OP_TABLE_MODES)}), part, [[x, seconds], ...] with x increasing and "
                                  f"both positive]; got {str(row)[:120]}")
        for k, m, _, c in self.op_times or ():
            if m == "clock" and not all(0 < y <= 1 for _, y in c):
                raise OffsimError(f"hardware {self.name}: op_times row ({k}, clock) holds a sustained clock fraction, "
                                  f"which must be in (0, 1]; got {[y for _, y in c]}")
        for f in ("gemm_efficiency", "attn_prefill_efficiency", "attn_decode_efficiency", "h2d_pinned", "d2h_pinned",
                  "h2d_pageable", "d2h_pageable"):
            c = getattr(self, f)
            if not c or any(len(p) != 2 or not p[0] > 0 or not p[1] > 0 or not all(map(math.isfinite, p))
                            for p in c):
                raise OffsimError(f"hardware {self.name}: {f} must be a non-empty list of finite positive [x, y] "
                                  "pairs")
            if any(a[0] >= b[0] for a, b in zip(c, c[1:])):
                raise OffsimError(f"hardware {self.name}: {f} x values must increase")
        # achieved / peak FLOP/s: a share of the peak, which a measurement may pass by a little where the peak is
        # itself a measurement (``offexec profile`` on the CPU: the best GEMM it timed, 1.02 seen); twice the peak
        # is a wrong peak or a wrong curve
        for f in ("gemm_efficiency", "attn_prefill_efficiency"):
            if any(y > MAX_FLOP_EFFICIENCY for _, y in getattr(self, f)):
                raise OffsimError(f"hardware {self.name}: {f} is achieved / peak FLOP/s, at most "
                                  f"{MAX_FLOP_EFFICIENCY:g}; got {max(y for _, y in getattr(self, f))}")
        for f in ("h2d_relay", "d2h_relay", "disk_read_op", "disk_write_op"):  # optional: empty where not measured
            c = getattr(self, f)
            if any(len(p) != 2 or not p[0] > 0 or not p[1] > 0 or not all(map(math.isfinite, p)) for p in c) \
                    or any(a[0] >= b[0] for a, b in zip(c, c[1:])):
                unit = "seconds" if f.startswith("disk") else "bytes/s"
                raise OffsimError(f"hardware {self.name}: {f} must be a list of positive [bytes, {unit}] pairs with "
                                  "bytes increasing (empty: not measured)")

    def with_(self, **changes) -> "HardwareSpec":
        """A copy with fields replaced (e.g. a smaller GPU memory budget)."""
        d = self.to_dict()
        d.pop("schema")
        d.update(changes)
        return HardwareSpec.from_dict(d)

    def scaled_link(self, factor: float) -> "HardwareSpec":
        """A copy whose PCIe bandwidths (the pinned, pageable and relay curves) are multiplied by ``factor`` (> 0)."""
        if not factor > 0:
            raise OffsimError(f"a link bandwidth factor must be positive, got {factor}")
        sc = lambda c: tuple((x, y * factor) for x, y in c)  # noqa: E731
        return self.with_(h2d_pinned=sc(self.h2d_pinned), d2h_pinned=sc(self.d2h_pinned),
                          h2d_pageable=sc(self.h2d_pageable), d2h_pageable=sc(self.d2h_pageable),
                          h2d_relay=sc(self.h2d_relay), d2h_relay=sc(self.d2h_relay))

    def to_dict(self) -> dict:
        d = {"schema": HARDWARE_SCHEMA}
        for f in fields(self):
            v = getattr(self, f.name)
            if (f.name in ("gpu_link_bytes_per_s", "quant_store_bytes_per_s", "quant_weight_bytes_per_s",
                           "network_bytes_per_s", "h2d_relay", "d2h_relay", "disk_read_op", "disk_write_op")
                and not v) \
                    or (f.name == "link_concurrent_fraction" and v == 1.0):
                continue  # (not measured: left out, so profiles written before the field read back the same)
            if f.name == "op_times":
                v = [[k, m, p, [list(q) for q in c]] for k, m, p, c in v]
            d[f.name] = [list(p) for p in v] if isinstance(v, tuple) else v
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "hardware profile") -> "HardwareSpec":
        d = dict(d)
        schema = d.pop("schema", HARDWARE_SCHEMA)
        if schema != HARDWARE_SCHEMA:
            raise OffsimError(f"{where}: field 'schema' is {schema!r}; this offsim reads {HARDWARE_SCHEMA!r}")
        d.pop("provenance", None)  # free-form, kept in the file only
        names = {f.name: f for f in fields(cls)}
        unknown = set(d) - set(names)
        if unknown:
            raise OffsimError(f"{where}: unknown fields {sorted(unknown)}")
        missing = [n for n, f in names.items() if f.default is MISSING and f.default_factory is MISSING
                   and n not in d]
        if missing:
            raise OffsimError(f"{where}: missing required fields {missing} (`offexec profile` writes them all)")
        for k, v in d.items():  # each field's type first, so that a wrong one is named as such
            t = names[k].type
            if t == "str":
                ok, kind = isinstance(v, str), "a string"
            elif t == "Curve":
                ok, kind = isinstance(v, (list, tuple)) and all(
                    isinstance(p, (list, tuple)) and len(p) == 2
                    and all(isinstance(z, (int, float)) and not isinstance(z, bool) for z in p) for p in v), \
                    "a list of [x, y] number pairs"
            elif t in ("int", "float"):
                ok, kind = isinstance(v, (int, float)) and not isinstance(v, bool), "a number"
            else:
                continue
            if not ok:
                raise OffsimError(f"{where}: field {k!r} must be {kind}, got {v!r}")
        try:
            for k, v in list(d.items()):
                if k == "op_times":
                    d[k] = _op_times_from_json(v, where)
                elif isinstance(v, list):
                    d[k] = tuple((float(a), float(b)) for a, b in v)
            return cls(**d)
        except OffsimError:
            raise
        except TypeError as e:
            raise OffsimError(f"{where}: {e}") from None
        except (ValueError, IndexError) as e:
            raise OffsimError(f"{where}: malformed curve ({e})") from None

    @classmethod
    def from_json(cls, path: str | Path) -> "HardwareSpec":
        from offsim.core.io import read_json_object

        return cls.from_dict(read_json_object(path, "hardware profile"), where=f"hardware profile {path}")


# Presets are hardware profiles kept as data: offsim/core/presets/hardware/<name>.json, in the schema above, each
# with a ``provenance`` map that gives every field's source (datasheet, paper, probe, or "estimate").
HARDWARE_PRESETS = ("t4", "rtx3090", "a800", "h200")


def _preset_profile(name: str):
    """The packaged JSON file of preset ``name`` (shipped as package data, see pyproject.toml)."""
    from importlib.resources import files

    return files("offsim.core").joinpath("presets", "hardware", f"{name}.json")


def load_hardware_preset(name: str) -> HardwareSpec:
    """Preset ``name`` (one of ``HARDWARE_PRESETS``) from its packaged profile JSON."""
    if name not in HARDWARE_PRESETS:
        raise OffsimError(f"unknown hardware preset {name!r}; valid: {', '.join(HARDWARE_PRESETS)}")
    f = _preset_profile(name)
    try:
        d = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise OffsimError(f"hardware preset {name}: cannot read its profile {f} ({e}); reinstall offsim") from None
    return HardwareSpec.from_dict(d, where=f"hardware preset {name} ({f})")


def get_hardware(name_or_path: str | Path, gpu_mem_gb: float | None = None) -> HardwareSpec:
    """A preset by name or a hardware-profile JSON; ``gpu_mem_gb`` (GiB) overrides the GPU memory (a budget)."""
    key = str(name_or_path)
    if key.lower() in HARDWARE_PRESETS:
        hw = load_hardware_preset(key.lower())
    elif key.endswith(".json") or Path(key).exists():
        hw = HardwareSpec.from_json(key)
    else:
        raise OffsimError(f"unknown hardware {key!r}; valid presets: {', '.join(HARDWARE_PRESETS)} "
                          "(or a hardware-profile JSON written by `offexec profile`)")
    if gpu_mem_gb is not None:
        try:
            gb = math.nan if isinstance(gpu_mem_gb, bool) else float(gpu_mem_gb)
        except (TypeError, ValueError):
            gb = math.nan
        if not (math.isfinite(gb * GiB) and gb * GiB >= 1):
            raise OffsimError(f"--gpu-mem-gb must be a finite number of GiB of at least one byte, got {gpu_mem_gb!r}")
        hw = hw.with_(gpu_mem_bytes=int(gb * GiB))
    return hw


# ----------------------------------------------------------------------------------------------------------------
# Workload
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """What to generate: ``num_gpu_batches`` batches of ``gpu_batch_size`` prompts (one FlexGen block), each prompt
    ``prompt_len`` tokens, ``gen_len`` tokens generated per prompt (the first by prefill).

    Mixed lengths (``offsim job``, docs/jobs.md): ``prompt_lens`` and ``gen_lens`` give each prompt's own lengths,
    in batch order (GPU batch k holds prompts [k·gpu_batch_size, (k+1)·gpu_batch_size)); empty, every prompt has
    ``prompt_len`` and ``gen_len``. A batch runs padded to its longest prompt (``batch_prompt_len``), as FlexGen pads
    a batch: its ops compute and store the KV of that many positions, and every sequence of the block runs all
    ``gen_len`` steps (a request whose ``gen_lens`` entry is smaller is done earlier; its later tokens are padding).
    An entry of 0 (in both lists) is an empty slot of a partly filled last batch: padding only. ``prompt_len`` and
    ``gen_len`` stay the block's maxima, so every size that depends on them (buffers, the footprint) is an upper
    bound.

    ``reserve_key_mask``: plan GPU memory for the per-sequence key mask a left-padded batch's ops hold
    (``footprint.mask_bytes``) although these lengths are uniform -- the worst case an offline job searches its
    policies at, its longest prompt and generation, so that every padded block of the job fits in what the search
    placed (``offsim.search.job``). Only the memory arithmetic reads it (``key_masked``); the ops and their prices
    are those of the lengths given."""

    prompt_len: int
    gen_len: int
    gpu_batch_size: int = 1
    num_gpu_batches: int = 1
    prompt_lens: tuple[int, ...] = field(default=())  # per prompt, batch order; () = all prompt_len; 0 = empty slot
    gen_lens: tuple[int, ...] = field(default=())  # per prompt, batch order; () = all gen_len; 0 = empty slot
    reserve_key_mask: bool = False  # memory for a padded batch's key mask, lengths uniform (docstring)

    def __post_init__(self):
        if not isinstance(self.reserve_key_mask, bool):
            raise OffsimError(f"reserve_key_mask is true or false, got {self.reserve_key_mask!r}")
        for f in ("prompt_len", "gen_len", "gpu_batch_size", "num_gpu_batches"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise OffsimError(f"{f.replace('_', '-')} must be a positive integer, got {v!r}")
        for f, top in (("prompt_lens", self.prompt_len), ("gen_lens", self.gen_len)):
            lens = getattr(self, f)
            if not lens:
                continue
            if len(lens) != self.num_prompts:
                raise OffsimError(f"{f} lists {len(lens)} lengths for {self.num_prompts} prompts "
                                  f"({self.num_gpu_batches} x {self.gpu_batch_size})")
            bad = [v for v in lens if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= top]
            if bad:
                raise OffsimError(f"{f}: lengths are integers in [0, {top}] (0: an empty slot), got {bad[0]!r}")
        if bool(self.prompt_lens) != bool(self.gen_lens):
            raise OffsimError("prompt_lens and gen_lens go together: give both per-prompt lists or neither")
        if self.prompt_lens:
            if [p == 0 for p in self.prompt_lens] != [g == 0 for g in self.gen_lens]:
                raise OffsimError("prompt_lens and gen_lens must mark the same empty slots (0 in both)")
            for k in range(self.num_gpu_batches):
                if not any(self._slice(self.prompt_lens, k)):
                    raise OffsimError(f"GPU batch {k} has no prompt (every slot empty)")

    @property
    def num_prompts(self) -> int:
        return self.gpu_batch_size * self.num_gpu_batches

    @property
    def max_len(self) -> int:
        """Tokens in a sequence at the end of generation (the last generated token's KV is never needed)."""
        return self.prompt_len + self.gen_len - 1

    # -- mixed lengths ------------------------------------------------------------------------------------------
    def _slice(self, lens: tuple[int, ...], k: int) -> tuple[int, ...]:
        return lens[k * self.gpu_batch_size:(k + 1) * self.gpu_batch_size]

    @functools.cached_property
    def batch_prompt_lens(self) -> tuple[int, ...]:
        """Per GPU batch, the prompt length it runs at: its longest prompt (padded to the batch maximum). Computed
        once per workload (plan builders and the executor ask for it per batch and step)."""
        if not self.prompt_lens:
            return (self.prompt_len,) * self.num_gpu_batches
        return tuple(max(self._slice(self.prompt_lens, k)) for k in range(self.num_gpu_batches))

    @functools.cached_property
    def padded(self) -> bool:
        """Whether some request is shorter than its GPU batch's prompt length: then offexec left-pads the batches
        and every attention runs under a per-sequence key mask (docs/jobs.md §4), priced from the profile's masked
        attention rows (``costmodel.attention_seconds``)."""
        lens = self.batch_prompt_lens
        return bool(self.prompt_lens) and any(0 < p < lens[i // self.gpu_batch_size]
                                              for i, p in enumerate(self.prompt_lens))

    @property
    def key_masked(self) -> bool:
        """Whether the GPU must hold a key mask beside each op (``footprint``): a padded batch, or its worst case
        reserved (``reserve_key_mask``)."""
        return self.padded or self.reserve_key_mask

    def batch_mean_prompt_len(self, k: int) -> int:
        """GPU batch k's mean prompt length over its requests (empty slots left out), rounded to a token (halves
        up): what TightLLM's Algorithm 1 estimates for a batch."""
        if not self.prompt_lens:
            return self.prompt_len
        real = [p for p in self._slice(self.prompt_lens, k) if p]
        return (2 * sum(real) + len(real)) // (2 * len(real))  # floor(mean + 1/2), in integers

    def request_lens(self) -> list[tuple[int, int, int]]:
        """(GPU batch, prompt length, generation length) of every request, in batch order, empty slots left out."""
        if not self.prompt_lens:
            return [(k, self.prompt_len, self.gen_len) for k in range(self.num_gpu_batches)
                    for _ in range(self.gpu_batch_size)]
        return [(i // self.gpu_batch_size, p, g) for i, (p, g) in enumerate(zip(self.prompt_lens, self.gen_lens))
                if p]

    def slot_tokens(self) -> int:
        """Token positions the block computes: every slot of batch k at its padded prompt plus all ``gen_len``
        steps. Against the requests' own tokens this is the padding waste (``offsim.search.job``)."""
        return self.gpu_batch_size * sum(p + self.gen_len for p in self.batch_prompt_lens)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prompt_lens"] = list(self.prompt_lens)
        if self.gen_lens:
            d["gen_lens"] = list(self.gen_lens)
        else:
            del d["gen_lens"]  # (plans of uniform workloads serialise as they did before mixed lengths)
        if not self.reserve_key_mask:
            del d["reserve_key_mask"]  # (and plans without the reserve as they did before it)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Workload":
        d = dict(d)
        d["prompt_lens"] = tuple(d.get("prompt_lens", ()))
        d["gen_lens"] = tuple(d.get("gen_lens", ()))
        return cls(**d)

    def with_(self, **changes) -> "Workload":
        d = asdict(self)
        d.update(changes)
        return Workload(**d)
