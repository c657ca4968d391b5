"""Broken model files: every fault is one DFlashConfigError naming the file, the field and the value.

Targets (safetensors directories, GGUF files, config.json), drafter config.json fields,
drafter weights (dtypes, NaN/Inf, per-tensor SHA-256 checksums) and atomic drafter export.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_models import cached_target, tiny_drafter, tiny_target

from tensorrt_llm_dflash.assets import DEMO_DRAFTER_DIR, demo_drafter_dir
from tensorrt_llm_dflash.config import MAX_BLOCK_SIZE, DFlashDraftConfig
from tensorrt_llm_dflash.drafter import (
    CHECKSUM_KEY,
    load_dflash_drafter,
    save_dflash_drafter,
    tensor_sha256,
    verify_checksums,
)
from tensorrt_llm_dflash.errors import DFlashConfigError
from tensorrt_llm_dflash.target import embedded_target_gguf, load_target, load_tokenizer

# ------------------------------------------------------------------ helpers


def _tiny_tokenizer(directory: Path, vocab: int = 32) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t2", bos_token="t0", eos_token="t1",
                            pad_token="t1").save_pretrained(directory)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3 target saved as a Hugging Face directory (safetensors) with a tokenizer."""
    directory = tmp_path_factory.mktemp("target")
    tiny_target("qwen3", vocab=32).save_pretrained(directory)
    _tiny_tokenizer(directory)
    return directory


@pytest.fixture
def target_copy(target_dir, tmp_path) -> Path:
    directory = tmp_path / "target"
    shutil.copytree(target_dir, directory)
    return directory


def _edit_config(directory: Path, **fields) -> None:
    raw = json.loads((directory / "config.json").read_text())
    raw.update(fields)
    (directory / "config.json").write_text(json.dumps(raw))


def _header(file: Path) -> tuple[int, dict]:
    data = file.read_bytes()
    length = int.from_bytes(data[:8], "little")
    return length, json.loads(data[8:8 + length])


def _refused(call, *fragments) -> str:
    with pytest.raises(DFlashConfigError) as err:
        call()
    message = str(err.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# ------------------------------------------------------------------ A: target files


def test_valid_tiny_target_still_loads(target_copy):
    # Not a regression test for a defect: the new checks must not refuse a sound target,
    # including a Llama config whose head_dim is null (transformers derives it).
    model, tokenizer = load_target(target_copy, dtype=torch.float64)
    assert model.config.hidden_size == 32 and tokenizer("t3 t4")["input_ids"] == [3, 4]
    llama = target_copy.parent / "llama"
    tiny_target("llama", vocab=32).save_pretrained(llama)
    _tiny_tokenizer(llama)
    _edit_config(llama, head_dim=None)
    assert load_target(llama, dtype=torch.float64)[0].config.head_dim == 8


def test_target_truncated_safetensors_is_named(target_copy):
    weights = target_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    _refused(lambda: load_target(target_copy), str(weights), "truncated")
    weights.write_bytes(data[:20])  # cut inside the header
    _refused(lambda: load_target(target_copy), str(weights), "truncated")
    weights.write_bytes(b"")
    _refused(lambda: load_target(target_copy), str(weights), "0 bytes")


def test_target_corrupted_safetensors_is_named(target_copy):
    weights = target_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:8] + b"\xff" * 50 + data[58:])  # header bytes overwritten
    _refused(lambda: load_target(target_copy), str(weights), "corrupted")
    # A header that parses but names a dtype safetensors does not know: transformers' own
    # SafetensorError comes back as one DFlashConfigError naming the directory.
    length = int.from_bytes(data[:8], "little")
    header = data[8:8 + length].replace(b'"F64"', b'"X64"', 1)
    weights.write_bytes(data[:8] + header + data[8 + length:])
    _refused(lambda: load_target(target_copy), str(target_copy), "SafetensorError", "X64")


def test_target_config_not_json_or_not_object(target_copy):
    config = target_copy / "config.json"
    text = config.read_text()
    config.write_text(text[:40])
    _refused(lambda: load_target(target_copy), str(config), "not valid JSON")
    config.write_text("[1, 2]")
    _refused(lambda: load_target(target_copy), str(config), "must hold a JSON object, not an array")
    _refused(lambda: load_tokenizer(target_copy), str(config), "JSON object")


@pytest.mark.parametrize("field,value,shown", [
    ("hidden_size", "576", "hidden_size='576'"),
    ("hidden_size", None, "hidden_size=null"),
    ("hidden_size", 32.0, "hidden_size=32.0"),
    ("num_attention_heads", True, "num_attention_heads=True"),
    ("num_key_value_heads", 0, "num_key_value_heads=0"),
    ("vocab_size", -32, "vocab_size=-32"),
    ("rope_scaling", {"type": "nonsense", "factor": 2.0}, "'nonsense'"),
    ("rope_scaling", "linear", "rope_scaling='linear'"),
])
def test_target_config_field_types(target_copy, field, value, shown):
    _edit_config(target_copy, **{field: value})
    _refused(lambda: load_target(target_copy), str(target_copy / "config.json"), field, shown, "invalid")


def test_drafter_directory_given_as_target():
    # Today: a protobuf ImportError from the tokenizer. The drafter's config.json says what it is.
    _refused(lambda: load_target(DEMO_DRAFTER_DIR), str(DEMO_DRAFTER_DIR), "is a DFlash drafter",
             "DFlashDraftModel", "--draft_model_dir")


@pytest.fixture(scope="module")
def gguf_bytes() -> bytes:
    try:
        return embedded_target_gguf().read_bytes()
    except DFlashConfigError as err:
        pytest.fail(f"embedded target unavailable: {err}")


def test_target_gguf_truncated(gguf_bytes, tmp_path):
    file = tmp_path / "target.gguf"
    for size in (4096, 2):  # inside the metadata; inside the magic
        file.write_bytes(gguf_bytes[:size])
        _refused(lambda: load_target(file), str(file), f"{size} bytes")
        _refused(lambda: load_tokenizer(file), str(file))
    # An interrupted download: the tensor data stops part way (gguf's reader fails with a
    # numpy reshape error, which comes back as one DFlashConfigError naming the file).
    file.write_bytes(gguf_bytes[: int(len(gguf_bytes) * 0.6)])
    _refused(lambda: load_target(file), str(file), "truncated or corrupted")


def test_target_gguf_corrupted(gguf_bytes, tmp_path):
    file = tmp_path / "target.gguf"
    file.write_bytes(b"XXXX" + gguf_bytes[4:])
    _refused(lambda: load_target(file), str(file), "not a GGUF file", "b'XXXX'")
    damaged = bytearray(gguf_bytes)
    damaged[30:40] = b"\xff" * 10  # the first metadata key's length
    file.write_bytes(bytes(damaged))
    _refused(lambda: load_target(file), str(file), "truncated or corrupted")
    _refused(lambda: load_target(tmp_path), str(file), "truncated or corrupted")  # the directory form


# ------------------------------------------------------------------ A: drafter config.json


def _asset_config() -> dict:
    return json.loads((DEMO_DRAFTER_DIR / "config.json").read_text())


#: A z-lab style config (Qwen3-8B-DFlash-b16 layout): extra keys, rope_theta as an int.
ZLAB = {
    "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 16, "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288,
    "layer_types": ["full_attention"] * 5, "max_position_embeddings": 40960, "max_window_layers": 5,
    "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8,
    "num_target_layers": 36, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_published_configs_still_accepted():
    # Not a regression test for a defect: the schema must keep every real config working.
    asset = DFlashDraftConfig.from_pretrained(DEMO_DRAFTER_DIR)
    assert asset.block_size == 8 and asset.draft_vocab_size == 26040
    zlab = DFlashDraftConfig.from_dict(copy.deepcopy(ZLAB))
    assert zlab.rope_theta == 1000000 and zlab.dtype == "bfloat16" and zlab.extra["auto_map"]
    llama = copy.deepcopy(ZLAB)
    llama["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    llama["num_key_value_heads"] = None  # null means multi-head attention, as in transformers
    assert DFlashDraftConfig.from_dict(llama).num_key_value_heads == 32


def test_drafter_config_json_list(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2, 3]")
    _refused(lambda: DFlashDraftConfig.from_pretrained(tmp_path), str(tmp_path / "config.json"),
             "must hold a JSON object, not an array")
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{}")
    _refused(lambda: DFlashDraftConfig.from_pretrained(tmp_path), str(tmp_path / "config.json"))


def _set(path: str, value):
    def edit(raw):
        *parents, leaf = path.split(".")
        node = raw
        for key in parents:
            node = node[key]
        node[leaf] = value
    return edit


BAD_DRAFTER_FIELDS = [
    ("hidden_size", "576", "hidden_size='576' is invalid"),
    ("hidden_size", None, "hidden_size=null is invalid"),
    ("hidden_size", 576.0, "hidden_size=576.0 is invalid"),
    ("intermediate_size", -1536, "intermediate_size=-1536 is invalid"),
    ("num_hidden_layers", 2.9, "num_hidden_layers=2.9 is invalid"),
    ("num_key_value_heads", 0, "num_key_value_heads=0 is invalid"),
    ("vocab_size", "49152", "vocab_size='49152' is invalid"),
    ("block_size", 8.5, "block_size=8.5 is invalid"),
    ("block_size", 100000, f"block_size=100000 is invalid: it must be an integer in 2..{MAX_BLOCK_SIZE}"),
    ("block_size", True, "block_size=True is invalid"),
    ("block_size", 9000, "block_size=9000 is invalid"),
    ("rope_scaling", {"type": "nonsense"}, "its type 'nonsense' is not one of"),
    ("rope_scaling", {"rope_type": "linear"}, "'factor'"),
    ("rope_scaling", [1], "rope_scaling=[1] is invalid"),
    ("rms_norm_eps", 0, "rms_norm_eps=0 is invalid"),
    ("rms_norm_eps", float("inf"), "rms_norm_eps=inf is invalid"),
    ("rms_norm_eps", "1e-6", "rms_norm_eps='1e-6' is invalid"),
    ("rope_theta", -1.0, "rope_theta=-1.0 is invalid"),
    ("draft_vocab_size", 12360.0, "draft_vocab_size=12360.0 is invalid"),
    ("draft_vocab_size", "12360", "draft_vocab_size='12360' is invalid"),
    ("max_position_embeddings", 4, "block_size=8 is invalid: it exceeds max_position_embeddings=4"),
    ("head_dim", 63, "head_dim=63 is invalid"),
    ("attention_bias", "false", "attention_bias='false' is invalid"),
    ("num_target_layers", "30", "num_target_layers='30' is invalid"),
    ("layer_types", "full_attention", "layer_types='full_attention' is invalid"),
    ("dflash_config", [16], "dflash_config=[16] is invalid"),
    ("dflash_config.mask_token_id", 16.7, "dflash_config.mask_token_id=16.7 is invalid"),
    ("dflash_config.mask_token_id", -1, "dflash_config.mask_token_id=-1 is invalid"),
    ("dflash_config.mask_token_id", "16", "dflash_config.mask_token_id='16' is invalid"),
    ("dflash_config.target_layer_ids", "1,8,14", "dflash_config.target_layer_ids='1,8,14' is invalid"),
    ("dflash_config.target_layer_ids", [1.9], "entry 0 is 1.9"),
    ("dflash_config.target_layer_ids", [1, -8], "entry 1 is -8"),
]


@pytest.mark.parametrize("field,value,message", BAD_DRAFTER_FIELDS, ids=[f"{f}={v!r}" for f, v, _ in BAD_DRAFTER_FIELDS])
def test_drafter_config_fields_are_checked(tmp_path, field, value, message):
    raw = _asset_config()
    _set(field, value)(raw)
    _refused(lambda: DFlashDraftConfig.from_dict(copy.deepcopy(raw)), message)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    _refused(lambda: DFlashDraftConfig.from_pretrained(tmp_path), str(tmp_path / "config.json"), message)


# ------------------------------------------------------------------ B: drafter weights


@pytest.fixture
def drafter_dir(tmp_path) -> Path:
    target = cached_target("qwen3", seed=0, vocab=32)
    save_dflash_drafter(tiny_drafter(target, layers=2, draft_vocab_size=20), tmp_path / "drafter", dtype=torch.float32)
    return tmp_path / "drafter"


def _rewrite(directory: Path, edit) -> None:
    """Edit the tensors and save them back without checksums (as another tool would)."""
    tensors = load_file(str(directory / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_by_name(tmp_path, bad):
    target = cached_target("qwen3", seed=0, vocab=32)
    model = tiny_drafter(target, layers=2)
    save_dflash_drafter(model, tmp_path, dtype=torch.bfloat16)
    with torch.no_grad():
        model.layers[1].mlp.up_proj.weight[3, 5] = bad
    kind = "1 NaN and 0 infinite" if bad != bad else "0 NaN and 1 infinite"
    # Export refuses to write such a drafter (a diverged run), and leaves the previous one in place ...
    before = (tmp_path / "model.safetensors").read_bytes()
    _refused(lambda: save_dflash_drafter(model, tmp_path, dtype=torch.bfloat16),
             "tensor layers.1.mlp.up_proj.weight", kind, "being exported")
    assert (tmp_path / "model.safetensors").read_bytes() == before
    # ... and loading refuses one written by another tool.
    _rewrite(tmp_path, lambda t: t["layers.1.mlp.up_proj.weight"].__setitem__((3, 5), bad))
    _refused(lambda: load_dflash_drafter(tmp_path), "tensor layers.1.mlp.up_proj.weight", kind, str(tmp_path))


def test_integer_weights_are_refused(drafter_dir):
    _rewrite(drafter_dir, lambda t: t.update({"fc.weight": t["fc.weight"].to(torch.int8)}))
    _refused(lambda: load_dflash_drafter(drafter_dir), "tensor fc.weight", "dtype int8", str(drafter_dir))


def test_float_d2t_is_refused(drafter_dir):
    _rewrite(drafter_dir, lambda t: t.update({"d2t": t["d2t"].to(torch.float32)}))
    _refused(lambda: load_dflash_drafter(drafter_dir), "tensor d2t", "dtype float32", "integer dtype")


def test_export_writes_checksums_and_loading_verifies_them(drafter_dir):
    weights = drafter_dir / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        metadata = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    assert metadata["format"] == "pt"
    sums = json.loads(metadata[CHECKSUM_KEY])
    assert set(sums) == set(tensors) and all(sums[n] == tensor_sha256(t) for n, t in tensors.items())
    load_dflash_drafter(drafter_dir)
    # One flipped bit inside one tensor's bytes: invisible without the checksum.
    length, header = _header(weights)
    start, _ = header["layers.1.self_attn.v_proj.weight"]["data_offsets"]
    data = bytearray(weights.read_bytes())
    data[8 + length + start + 6] ^= 0x01
    weights.write_bytes(bytes(data))
    _refused(lambda: load_dflash_drafter(drafter_dir), "tensor layers.1.self_attn.v_proj.weight", str(weights),
             "SHA-256")


def test_corrupted_or_truncated_drafter_weights_are_named(drafter_dir):
    weights = drafter_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    _refused(lambda: load_dflash_drafter(drafter_dir), str(weights), "truncated")
    weights.write_bytes(data[:8] + b"\x00" * 40 + data[48:])
    _refused(lambda: load_dflash_drafter(drafter_dir), str(weights), "corrupted")
    weights.write_bytes(data + b"\x00" * 16)
    _refused(lambda: load_dflash_drafter(drafter_dir), str(weights), "16 bytes after")


def test_shipped_drafter_carries_checksums():
    weights = demo_drafter_dir() / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        metadata = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    assert metadata["format"] == "pt" and CHECKSUM_KEY in metadata
    assert verify_checksums(weights, tensors, metadata) is True
    assert len(tensors) == 26 and tensors["d2t"].dtype == torch.int64
    load_dflash_drafter(DEMO_DRAFTER_DIR)


def test_failed_export_keeps_the_previous_drafter(drafter_dir, monkeypatch):
    import safetensors.torch

    import tensorrt_llm_dflash.files as files

    before = {name: (drafter_dir / name).read_bytes() for name in ("config.json", "model.safetensors")}
    other = tiny_drafter(cached_target("qwen3", seed=0, vocab=32), layers=2, seed=5, draft_vocab_size=20)

    def half_written(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", half_written)
    with pytest.raises(OSError, match="disk full"):
        save_dflash_drafter(other, drafter_dir, dtype=torch.float32)
    monkeypatch.undo()
    assert {name: (drafter_dir / name).read_bytes() for name in before} == before

    def half_written_text(f, write):
        f.write("{")
        raise OSError("disk full")

    monkeypatch.setattr(files, "_write_stream", half_written_text)
    with pytest.raises(OSError, match="disk full"):
        save_dflash_drafter(other, drafter_dir, dtype=torch.float32)
    monkeypatch.undo()
    assert (drafter_dir / "config.json").read_bytes() == before["config.json"]
    assert not [p.name for p in drafter_dir.iterdir() if p.name.startswith(".")], "no temporaries left behind"
    load_dflash_drafter(drafter_dir)
