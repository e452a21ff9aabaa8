"""Model weights in host memory, in the executor's layout: one flat buffer per decoder layer
(``ModelSpec.layer_tensors`` order; a plan's weight op moves a byte range of it) plus the embeddings.

Three sources, one layout:
- ``random_weights``: seeded random values at the model's real size, generated on the GPU (or CPU) one tensor at a
  time and copied into page-locked host memory -- OPT-30B's 55.8 GB takes seconds of GPU time and as long as the
  host needs to fault in and lock the pages. The values depend on (seed, generating device).
- ``from_state_dict``: a transformers model's ``state_dict`` (tests copy tiny random transformers models this way).
- ``load_checkpoint``: a local checkpoint directory in transformers' layout (config.json + *.safetensors); names and
  shapes are checked against the model before anything large is allocated.

The host master holds every layer in full; the executor places each plan's tiers from it (GPU-resident bytes are
copied to the GPU, host-homed bytes are views of it, disk-homed bytes are written to the disk tier).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from tqdm import tqdm

from offsim.core import footprint as fp
from offsim.core.specs import WEIGHT_GROUP_DIM, Compression, ModelSpec

from . import quant
from .memory import ExecError, HostBuffer
from .model import Embeddings, dtype_of, layer_layout

INIT_STD = 0.02  # transformers' init_std / initializer_range for OPT and Llama


class ModelWeights:
    """Host master copy: ``layers`` [L, W] (W = elements of one layer's flat buffer) and ``emb``."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, pinned: bool = False):
        self.spec, self.dtype = spec, dtype
        if torch.empty(0, dtype=dtype).element_size() != spec.dtype_bytes:
            raise ExecError(f"dtype {dtype} has {torch.empty(0, dtype=dtype).element_size()} bytes per element but "
                            f"the model spec counts {spec.dtype_bytes}")
        self.layout = layer_layout(spec)
        self.layer_numel = self.layout[-1].hi
        self.host = HostBuffer(spec.num_layers * self.layer_numel, dtype, pinned and torch.cuda.is_available())
        self.layers = self.host.tensor.view(spec.num_layers, self.layer_numel)
        self.emb: Embeddings | None = None
        self.source = ""
        self.packed: PackedLayers | None = None  # the stored form with compressed weights (``packed_layers``)

    @property
    def pinned(self) -> bool:
        return self.host.pinned

    def set_pinned(self, pinned: bool) -> None:
        self.host.set_pinned(pinned and torch.cuda.is_available())
        if self.packed is not None:
            self.packed.host.set_pinned(pinned and torch.cuda.is_available())

    def nbytes(self) -> int:
        return self.host.nbytes + (self.emb.nbytes() if self.emb else 0)

    def close(self) -> None:
        self.host.close()
        if self.packed is not None:
            self.packed.close()
            self.packed = None

    def packed_layers(self, comp: Compression) -> "PackedLayers":
        """Every layer in its stored form for compression ``comp`` (made from the master once, then kept)."""
        if self.packed is None or self.packed.comp != comp:
            if self.packed is not None:
                self.packed.close()
            self.packed = PackedLayers(self, comp)
        self.packed.host.set_pinned(self.pinned)
        return self.packed


class PackedLayers:
    """Compressed weights (``compress_weight``, issue 16) as the executor's off-GPU tiers store them: every decoder
    layer as one flat uint8 buffer, ``layers`` [L, stored bytes of a layer], holding each tensor's stored form back to
    back in ``layer_tensors`` order -- a matrix as ``quant.to_bytes(quant.quantize_weight(m))``, a 1-D tensor as its
    raw bytes (``footprint.weight_tensor_is_packed``). Sizes and offsets are offsim's (``footprint``'s
    ``stored_weight_bytes`` / ``stored_weight_offset_bytes``): the plan addresses weights in fp16 bytes, and
    ``range`` maps such a range to the stored bytes its copy moves. Made from the fp16 master on the host (quantized
    on the GPU where there is one, else the CPU; once per ``ModelWeights``); host-homed bytes are views of it, disk-homed bytes are written from it."""

    def __init__(self, w: ModelWeights, comp: Compression):
        spec, e = w.spec, w.spec.dtype_bytes
        self.spec, self.comp, self.e = spec, comp, e
        self.layer_bytes = fp.stored_layer_weight_bytes(spec, comp)
        self.host = HostBuffer(spec.num_layers * self.layer_bytes, torch.uint8, False)
        self.layers = self.host.tensor.view(spec.num_layers, self.layer_bytes)
        # per tensor of the layout: (slot, first stored byte, stored bytes, packed 4-bit?)
        self.tensors = [(t, self.offset(t.lo * e), fp.stored_weight_bytes(spec, t.lo * e, t.hi * e, comp),
                         fp.weight_tensor_is_packed(t.shape, comp)) for t in w.layout]
        # quantized on the GPU where there is one: OPT-30B's 30 G parameters take seconds there, minutes on the CPU
        # (the same fp32 arithmetic; tests/test_compression.py compares the two devices' bytes)
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        for j in range(spec.num_layers):
            for t, off, n, packed in self.tensors:
                x = w.layers[j, t.lo:t.hi].view(t.shape)
                if packed:  # in row blocks: a run may pack under its GPU cap (the executor's setup)
                    quant.quantize_weight_into(x, self.layers[j, off:off + n], dev)
                else:
                    self.layers[j, off:off + n].copy_(x.reshape(-1).view(torch.uint8))

    def offset(self, lo_bytes: int) -> int:
        """First stored byte of fp16 byte ``lo_bytes`` of a layer (``footprint.stored_weight_offset_bytes``)."""
        return fp.stored_weight_offset_bytes(self.spec, lo_bytes, self.comp)

    def range(self, lo_bytes: int, hi_bytes: int) -> tuple[int, int]:
        """(first stored byte, stored bytes) that a copy of fp16 bytes [lo, hi) of a layer moves."""
        return self.offset(lo_bytes), fp.stored_weight_bytes(self.spec, lo_bytes, hi_bytes, self.comp)

    def unpack(self, t_index: int, src: torch.Tensor, out: torch.Tensor) -> None:
        """Tensor ``t_index`` of the layout from its stored bytes ``src`` (uint8, on ``out``'s device) into ``out``
        (its shape, the model's dtype): dequantized, or its raw bytes copied."""
        t, _, _, packed = self.tensors[t_index]
        if packed:
            quant.dequantize_into(src, t.shape, WEIGHT_GROUP_DIM, out)
        else:
            out.view(-1).view(torch.uint8).copy_(src)

    def close(self) -> None:
        self.host.close()


# ----------------------------------------------------------------------------------------------------------------
# transformers names
# ----------------------------------------------------------------------------------------------------------------
def hf_layer_name(spec: ModelSpec, prefix: str, j: int, name: str) -> str:
    """transformers' state-dict key of tensor ``name`` (a ``layer_tensors`` name) of decoder layer ``j``."""
    if spec.family == "opt":
        sub = "self_attn." if name.split(".")[0] in ("q_proj", "k_proj", "v_proj", "out_proj") else ""
        return f"{prefix}layers.{j}.{sub}{name}"
    mod = name.split(".")[0]
    sub = "self_attn." if mod in ("q_proj", "k_proj", "v_proj", "o_proj") else \
        "mlp." if mod in ("gate_proj", "up_proj", "down_proj") else ""
    return f"{prefix}layers.{j}.{sub}{name}"


def hf_embedding_names(spec: ModelSpec, prefix: str) -> dict[str, tuple[str, tuple[int, ...]] | None]:
    """Embeddings field -> (key, shape), None where the model has no such tensor."""
    V, E = spec.vocab_size, spec.d_model
    if spec.family == "opt":
        return {"tokens": (f"{prefix}embed_tokens.weight", (V, E)),
                "positions": (f"{prefix}embed_positions.weight", (spec.max_positions + 2, E)),
                "norm_w": (f"{prefix}final_layer_norm.weight", (E,)),
                "norm_b": (f"{prefix}final_layer_norm.bias", (E,)),
                "lm_head": None if spec.tie_word_embeddings else ("lm_head.weight", (V, E))}
    return {"tokens": (f"{prefix}embed_tokens.weight", (V, E)), "positions": None,
            "norm_w": (f"{prefix}norm.weight", (E,)), "norm_b": None,
            "lm_head": None if spec.tie_word_embeddings else ("lm_head.weight", (V, E))}


def _prefix(spec: ModelSpec, keys) -> str:
    cands = ("model.decoder.", "decoder.", "") if spec.family == "opt" else ("model.", "")
    for p in cands:
        if f"{p}embed_tokens.weight" in keys:
            return p
    raise ExecError(f"checkpoint has no token embedding (looked for {[c + 'embed_tokens.weight' for c in cands]})")


def _check_shapes(spec: ModelSpec, shapes: dict[str, tuple], where: str) -> str:
    """Every tensor the model needs is present with the right shape; returns the key prefix."""
    prefix = _prefix(spec, shapes)
    want = {}
    for j in range(spec.num_layers):
        for name, shape in spec.layer_tensors():
            want[hf_layer_name(spec, prefix, j, name)] = tuple(shape)
    for ks in hf_embedding_names(spec, prefix).values():
        if ks is not None:
            want[ks[0]] = ks[1]
    missing = [k for k in want if k not in shapes]
    if missing:
        raise ExecError(f"{where} lacks {len(missing)} tensors the model {spec.name} needs, e.g. {missing[:3]}")
    bad = [(k, shapes[k], s) for k, s in want.items() if tuple(shapes[k]) != s]
    if bad:
        k, got, exp = bad[0]
        raise ExecError(f"{where}: tensor {k} has shape {list(got)} but model {spec.name} needs {list(exp)} "
                        f"({len(bad)} tensors differ): the checkpoint does not match the model")
    return prefix


def _fill(w: ModelWeights, get, prefix: str, progress: bool, first_layer: int = 0) -> None:
    """Fill ``w``'s rows from the model's layers ``first_layer``, ``first_layer + 1``, ... and the embeddings."""
    spec = w.spec
    for j in tqdm(range(spec.num_layers), desc="weights", disable=not progress, leave=False):
        row = w.layers[j]
        for t in w.layout:
            row[t.lo:t.hi].copy_(get(hf_layer_name(spec, prefix, first_layer + j, t.name)).reshape(-1))
    emb = {}
    for field, ks in hf_embedding_names(spec, prefix).items():
        emb[field] = None if ks is None else get(ks[0]).to(w.dtype).clone()
    w.emb = Embeddings(**emb)


def from_state_dict(spec: ModelSpec, sd: dict, dtype: torch.dtype | None = None, pinned: bool = False,
                    progress: bool = False) -> ModelWeights:
    """From a transformers ``state_dict`` (OPTForCausalLM / LlamaForCausalLM)."""
    dtype = dtype or dtype_of(spec)
    _check_shapes(spec, {k: tuple(v.shape) for k, v in sd.items()}, "state dict")
    w = ModelWeights(spec, dtype, pinned)
    _fill(w, lambda k: sd[k], _prefix(spec, sd), progress)
    w.source = "state_dict"
    return w


def check_checkpoint_dir(path: str | Path) -> Path:
    """``path`` as a checkpoint folder, or an error that says it does not exist or is not a folder."""
    path = Path(path)
    if not path.is_dir():
        raise ExecError(f"--checkpoint {path} " + ("is not a directory" if path.exists() else "does not exist")
                        + " (a folder with config.json and *.safetensors)")
    return path


def load_checkpoint(path: str | Path, spec: ModelSpec | None = None, dtype: torch.dtype | None = None,
                    pinned: bool = False, progress: bool = True, layers: tuple[int, int] | None = None) -> ModelWeights:
    """From a local transformers checkpoint directory (config.json and one or more .safetensors files).
    ``layers`` [lo, hi): only those decoder layers (and the embeddings), as one pipeline stage holds them."""
    from safetensors import SafetensorError, safe_open

    path = check_checkpoint_dir(path)
    ck_spec = ModelSpec.from_hf_config(path)
    if spec is not None:
        diffs = [f for f in ("family", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "ffn_dim",
                             "vocab_size") if getattr(spec, f) != getattr(ck_spec, f)]
        if diffs:
            f = diffs[0]
            raise ExecError(f"checkpoint {path} does not match model {spec.name}: {f} is {getattr(ck_spec, f)} in its "
                            f"config.json, {getattr(spec, f)} in the model")
    spec = spec or ck_spec
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ExecError(f"checkpoint {path} has no .safetensors files")
    handles, where = [], {}
    shapes = {}
    for f in files:
        try:
            h = safe_open(str(f), framework="pt")
            handles.append(h)
            for k in h.keys():
                where[k] = (h, f)
                shapes[k] = tuple(h.get_slice(k).get_shape())
        except (SafetensorError, OSError) as e:
            raise ExecError(f"checkpoint {path}: {f.name} is not a readable safetensors file ({e})") from None
    if spec.tie_word_embeddings is False and "lm_head.weight" not in shapes:
        raise ExecError(f"checkpoint {path} lacks lm_head.weight (the model's LM head is not tied)")
    prefix = _check_shapes(spec, shapes, f"checkpoint {path}")  # before the large allocation
    lo, hi = _layer_range(spec, layers)
    w = ModelWeights(dataclasses.replace(spec, num_layers=hi - lo), dtype or dtype_of(spec), pinned)
    def tensor(k):
        h, f = where[k]
        try:
            return h.get_tensor(k)
        except (SafetensorError, OSError) as e:  # (a file cut short past its header: found only when read)
            w.close()
            raise ExecError(f"checkpoint {path}: {f.name} cannot be read at tensor {k} ({e}); the file is "
                            "damaged or cut short") from None

    _fill(w, tensor, prefix, progress, lo)
    w.source = f"checkpoint {path}"
    return w


def _layer_range(spec: ModelSpec, layers) -> tuple[int, int]:
    if layers is None:
        return 0, spec.num_layers
    lo, hi = layers
    if not 0 <= lo < hi <= spec.num_layers:
        raise ExecError(f"layers [{lo}, {hi}) are not a range of {spec.name}'s {spec.num_layers} layers")
    return lo, hi


# ----------------------------------------------------------------------------------------------------------------
# seeded random weights at real size
# ----------------------------------------------------------------------------------------------------------------
def _init_tensor(name: str, shape, gen: torch.Generator, device, dtype) -> torch.Tensor:
    """Values that keep a deep random model finite in fp16: matrices and biases N(0, 0.02²) (transformers' init),
    norm weights 1 + N(0, 0.02²), norm biases N(0, 0.02²)."""
    t = torch.randn(shape, generator=gen, device=device, dtype=dtype).mul_(INIT_STD)
    if "norm" in name and name.endswith("weight"):
        t.add_(1.0)
    return t


def random_weights(spec: ModelSpec, seed: int = 0, dtype: torch.dtype | None = None, device: str = "cpu",
                   pinned: bool = False, progress: bool = True, layers: tuple[int, int] | None = None) -> ModelWeights:
    """Seeded random weights at the model's real size, generated on ``device`` and parked in host memory.
    ``layers`` [lo, hi): only those decoder layers (the same values as in the whole model's) and the embeddings,
    as one pipeline stage holds them."""
    dtype = dtype or dtype_of(spec)
    dev = torch.device(device)
    lo, hi = _layer_range(spec, layers)
    w = ModelWeights(dataclasses.replace(spec, num_layers=hi - lo), dtype, pinned)
    nb = dev.type == "cuda" and w.pinned
    for j in tqdm(range(hi - lo), desc="random weights", disable=not progress, leave=False):
        gen = torch.Generator(device=dev).manual_seed(seed * 1_000_003 + lo + j)  # (the layer's seed in the model)
        row = w.layers[j]
        for t in w.layout:
            row[t.lo:t.hi].copy_(_init_tensor(t.name, (t.hi - t.lo,), gen, dev, dtype), non_blocking=nb)
        if nb and j % 4 == 3:
            torch.cuda.current_stream(dev).synchronize()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    gen = torch.Generator(device=dev).manual_seed(seed * 1_000_003 + spec.num_layers)
    emb = {}
    for field, ks in hf_embedding_names(spec, "").items():
        emb[field] = None if ks is None else _init_tensor(field if field != "norm_w" else "norm.weight", ks[1], gen,
                                                          dev, dtype).cpu()
    w.emb = Embeddings(**emb)
    w.source = f"random seed {seed} on {dev.type}"
    return w


def config_json(spec: ModelSpec) -> str:
    """A transformers config.json for ``spec`` (to write a checkpoint next to random weights)."""
    return json.dumps(spec.to_hf_config_dict(), indent=1)
