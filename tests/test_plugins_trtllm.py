"""tensorrt_llm_dflash.trtllm.plugins without TensorRT: attributes, loading, wiring.

TensorRT and TensorRT-LLM are not installed here, so the network insertion is checked
against stand-in modules that record the calls (registry lookup, create_plugin phase,
add_plugin_v3 arguments, output wrapping). The attribute names and order are checked
against the C++ creators' field tables.
"""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from tensorrt_llm_dflash.errors import DFlashInputError
from tensorrt_llm_dflash.trtllm import plugins

TRT_SOURCES = Path(__file__).resolve().parent.parent / "plugins" / "src" / "trt"


def cpp_field_names(source: str) -> list[str]:
    """Names of the Int32FieldSpec table entries in a plugin .cpp, in order."""
    text = (TRT_SOURCES / source).read_text()
    table = text[text.index("kFieldSpecs[") : text.index("};", text.index("kFieldSpecs["))]
    return re.findall(r'\{"(\w+)",', table)


def test_import_needs_neither_tensorrt_nor_tensorrt_llm() -> None:
    # torch is checked relative to the package itself (whose __init__ is not ours).
    code = (
        "import sys, tensorrt_llm_dflash\n"
        "torch_before = 'torch' in sys.modules\n"
        "import tensorrt_llm_dflash.trtllm.plugins, tensorrt_llm_dflash.kernels\n"
        "bad = [m for m in ('tensorrt', 'tensorrt_llm') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "assert torch_before or 'torch' not in sys.modules, 'kernels/plugins imported torch eagerly'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_field_names_match_cpp_creators() -> None:
    assert list(plugins.tree_mask_fields()) == cpp_field_names("tree_mask_plugin.cpp")
    fields = plugins.kv_compact_fields(
        paged=True, num_layers=2, num_kv_heads=8, head_size=128, kv_cache_dtype="bfloat16"
    )
    assert list(fields) == cpp_field_names("kv_compact_plugin.cpp")


def test_kv_compact_fields_values() -> None:
    paged = plugins.kv_compact_fields(
        paged=True, num_layers=32, num_kv_heads=8, head_size=128, kv_cache_dtype="float16", tokens_per_block=32
    )
    assert paged == {
        "layout": 1, "num_layers": 32, "num_kv_heads": 8, "head_size": 128,
        "elem_bytes": 2, "tokens_per_block": 32, "max_seq_len": 0,
    }
    linear = plugins.kv_compact_fields(
        paged=False, num_layers=2, num_kv_heads=4, head_size=64, kv_cache_dtype="fp8", max_seq_len=4096
    )
    assert linear["layout"] == 0 and linear["elem_bytes"] == 1 and linear["max_seq_len"] == 4096


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"tokens_per_block": 48}, "tokens_per_block=48 must be a power of two"),
        ({"num_layers": 0}, "num_layers=0 is out of range"),
        ({"kv_cache_dtype": "float64"}, "kv_cache_dtype='float64' is not one of"),
        ({"head_size": 2.5}, "head_size must be an integer"),
    ],
)
def test_kv_compact_fields_refuse_bad_attributes(kwargs: dict, fragment: str) -> None:
    args = {"paged": True, "num_layers": 2, "num_kv_heads": 2, "head_size": 64, "kv_cache_dtype": "float16"}
    args.update(kwargs)
    with pytest.raises(DFlashInputError, match=re.escape(fragment)):
        plugins.kv_compact_fields(**args)


def test_linear_layout_needs_max_seq_len() -> None:
    with pytest.raises(DFlashInputError, match="max_seq_len=0 must be >= 1"):
        plugins.kv_compact_fields(paged=False, num_layers=1, num_kv_heads=1, head_size=8, kv_cache_dtype=2)


def test_tree_mask_fields_range() -> None:
    assert plugins.tree_mask_fields(64) == {"max_nodes": 64}
    with pytest.raises(DFlashInputError, match=r"max_nodes=1025 is out of range 1\.\.1024"):
        plugins.tree_mask_fields(1025)


def test_load_plugin_library_missing_says_how_to_build(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="TensorRT_ROOT"):
        plugins.load_plugin_library(tmp_path / "nope.so")


# ------------------------------------------------------------- stand-in modules


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []


def _fake_tensorrt(recorder: _Recorder, registered: bool = True) -> types.ModuleType:
    trt = types.ModuleType("tensorrt")

    class PluginField:
        def __init__(self, name: str, data: np.ndarray, kind: str) -> None:
            self.name, self.data, self.type = name, data, kind

    class Creator:
        def create_plugin(self, name: str, collection: list, phase: str) -> dict:
            recorder.calls.append(("create_plugin", name, phase, {f.name: f.data for f in collection}))
            return {"plugin": name}

    class Registry:
        def get_creator(self, name: str, version: str, namespace: str) -> Creator | None:
            recorder.calls.append(("get_creator", name, version, namespace))
            return Creator() if registered else None

    trt.PluginField = PluginField
    trt.PluginFieldCollection = list
    trt.PluginFieldType = types.SimpleNamespace(INT32="INT32")
    trt.TensorRTPhase = types.SimpleNamespace(BUILD="BUILD")
    trt.get_plugin_registry = Registry
    return trt


def _fake_tensorrt_llm(recorder: _Recorder) -> dict[str, types.ModuleType]:
    class Layer:
        def get_output(self, index: int) -> str:
            return f"out{index}"

    class Network:
        def add_plugin_v3(self, inputs: list, shape_inputs: list, plugin: dict) -> Layer:
            recorder.calls.append(("add_plugin_v3", inputs, shape_inputs, plugin))
            return Layer()

    common = types.ModuleType("tensorrt_llm._common")
    common.default_trtnet = Network
    functional = types.ModuleType("tensorrt_llm.functional")
    functional._create_tensor = lambda trt_tensor, producer: ("Tensor", trt_tensor)
    return {"tensorrt_llm": types.ModuleType("tensorrt_llm"), "tensorrt_llm._common": common,
            "tensorrt_llm.functional": functional}


def _tensor(name: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(trt_tensor=name)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    rec = _Recorder()
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_tensorrt(rec))
    for name, module in _fake_tensorrt_llm(rec).items():
        monkeypatch.setitem(sys.modules, name, module)
    return rec


def test_tree_mask_inserts_v3_plugin(recorder: _Recorder) -> None:
    outputs = plugins.tree_mask(_tensor("parents"), _tensor("lengths"), max_nodes=128)
    assert outputs == (("Tensor", "out0"), ("Tensor", "out1"), ("Tensor", "out2"))
    get_creator, create, add = recorder.calls
    assert get_creator == ("get_creator", "DFlashTreeMask", "1", "dflash")
    assert create[:3] == ("create_plugin", "dflash_tree_mask", "BUILD")
    assert create[3]["max_nodes"].dtype == np.int32 and create[3]["max_nodes"].tolist() == [128]
    assert add == ("add_plugin_v3", ["parents", "lengths"], [], {"plugin": "dflash_tree_mask"})


def test_kv_compact_paged_inserts_v3_plugin(recorder: _Recorder) -> None:
    names = ["accepted", "num_accepted", "past", "offsets", "pool_pointers", "pool_mapping"]
    committed = plugins.kv_compact_paged(
        *[_tensor(n) for n in names], num_layers=4, num_kv_heads=2, head_size=64,
        kv_cache_dtype="bfloat16", tokens_per_block=16,
    )
    assert committed == ("Tensor", "out0")
    _, create, add = recorder.calls
    assert {k: v.tolist() for k, v in create[3].items()} == {
        "layout": [1], "num_layers": [4], "num_kv_heads": [2], "head_size": [64],
        "elem_bytes": [2], "tokens_per_block": [16], "max_seq_len": [0],
    }
    assert add[1] == names and add[2] == []


def test_kv_compact_linear_inserts_v3_plugin(recorder: _Recorder) -> None:
    names = ["accepted", "num_accepted", "past", "layer_pointers"]
    plugins.kv_compact_linear(
        *[_tensor(n) for n in names], num_layers=2, num_kv_heads=2, head_size=8,
        kv_cache_dtype="float32", max_seq_len=256,
    )
    _, create, add = recorder.calls
    assert create[3]["layout"].tolist() == [0] and create[3]["max_seq_len"].tolist() == [256]
    assert add[1] == names


def test_unregistered_creator_says_to_load_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_tensorrt(_Recorder(), registered=False))
    with pytest.raises(RuntimeError, match="load_plugin_library"):
        plugins.tree_mask(_tensor("p"), _tensor("l"))
