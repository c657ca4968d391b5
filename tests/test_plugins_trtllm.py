"""tensorrt_llm_dflash.trtllm.plugins: attributes, library loading and registration, insertion.

The insertion runs against the TensorRT / TensorRT-LLM stand-in (tests/trtllm_standin): the
plugins are created from the registry under the namespace the library registered, added to a
network with ``add_plugin_v3`` and wrapped as TensorRT-LLM tensors, exactly as in a build.
The attribute names, order, defaults and ranges are the C++ creators' tables.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import standin

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
        "layout": 1, "num_layers": 32, "num_kv_heads": 8, "head_size": 128, "elem_bytes": 2, "tokens_per_block": 32,
    }
    linear = plugins.kv_compact_fields(paged=False, num_layers=2, num_kv_heads=4, head_size=64, kv_cache_dtype="fp8")
    assert linear["layout"] == 0 and linear["elem_bytes"] == 1


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


def test_tree_mask_fields_range() -> None:
    assert plugins.tree_mask_fields(64) == {"max_nodes": 64}
    with pytest.raises(DFlashInputError, match=r"max_nodes=1025 is out of range 1\.\.1024"):
        plugins.tree_mask_fields(1025)


def test_load_plugin_library_missing_says_how_to_build(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="TensorRT_ROOT"):
        plugins.load_plugin_library(tmp_path / "nope.so")


def test_a_missing_plugin_library_is_a_dflash_error(tmp_path: Path) -> None:
    """run.py --engine_dir without the plugin library ended in a traceback (exit 1): the loader raised a bare
    FileNotFoundError, which the CLIs' one-line handler (DFlashError) does not take. It is both now."""
    from tensorrt_llm_dflash.errors import DFlashError

    with pytest.raises(DFlashError, match="libdflash_trt_plugins.so not found") as raised:
        plugins.load_plugin_library(tmp_path / "nope.so")
    assert isinstance(raised.value, FileNotFoundError)  # what _create_plugin and older callers catch


def test_library_without_init_function_is_refused(tmp_path: Path) -> None:
    """An old library (REGISTER_TENSORRT_PLUGIN, namespace "") has no initDFlashPlugins."""
    source = tmp_path / "old.c"
    source.write_text("int dflash_something_else(void) { return 0; }\n")
    library = tmp_path / "libold.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    with pytest.raises(RuntimeError, match="has no initDFlashPlugins: rebuild plugins/"):
        plugins.load_plugin_library(library)


def test_a_corrupt_or_truncated_plugin_library_is_named_not_a_crash(tmp_path: Path) -> None:
    """A library a killed link or copy left half-written: ctypes raised a bare OSError ("file too short")
    for a short one, and a truncated one whose segments reach past its end killed Python with SIGBUS
    inside dlopen (no message at all). Both are refused by name, before dlopen, saying to rebuild."""
    import _ctypes

    whole = Path(_ctypes.__file__).read_bytes()  # any real shared library
    cases = {"garbage.so": b"not a library\n", "truncated.so": whole[:4096], "half.so": whole[: len(whole) // 2]}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    code = (
        "import sys\n"
        "from tensorrt_llm_dflash.trtllm import plugins\n"
        "for path in sys.argv[1:]:\n"
        "    try:\n"
        "        plugins.load_plugin_library(path)\n"
        "    except getattr(plugins, 'PluginLibraryError', Exception) as err:\n"  # before the fix: any exception
        "        print(err)\n"
    )
    result = subprocess.run([sys.executable, "-c", code, *(str(tmp_path / name) for name in cases)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == len(cases), result.stdout
    for line, name in zip(lines, cases):
        assert f"{tmp_path / name} is not a loadable shared library" in line, line
        assert "rebuild" in line and "DFLASH_TRT_PLUGIN_LIB" in line, line


@pytest.fixture
def network(tmp_path: Path):
    """A stand-in TensorRT-LLM network under construction, with the plugin library loaded."""
    with standin.active(tmp_path / "lib"):
        import tensorrt as trt
        from tensorrt_llm.builder import Builder
        from tensorrt_llm.network import net_guard

        plugins.load_plugin_library()
        net = Builder().create_network()
        with net_guard(net):
            yield trt, net


def _input(name: str, dtype, shape):
    from tensorrt_llm.functional import Tensor

    return Tensor(name=name, dtype=dtype, shape=shape)


def test_namespace_of_registration_lookup_and_plugins_agree(network) -> None:
    """Defect 5 of docs/trtllm_engine.md: registered, looked up and reported under one namespace."""
    trt, _ = network
    registry = trt.get_plugin_registry()
    for name in (plugins.TREE_MASK_PLUGIN, plugins.KV_COMPACT_PLUGIN):
        creator = registry.get_creator(name, plugins.PLUGIN_VERSION, plugins.PLUGIN_NAMESPACE)
        assert creator is not None and creator.plugin_namespace == plugins.PLUGIN_NAMESPACE
        assert registry.get_creator(name, plugins.PLUGIN_VERSION, "") is None  # not under ""
    parents = _input("parents", trt.int32, [1, -1])
    lengths = _input("lengths", trt.int32, [1])
    packed, offsets, lengths_out = plugins.tree_mask(parents, lengths, max_nodes=49)
    layer = packed.producer
    assert layer.type == "PLUGIN_V3"
    plugin = layer._record.plugin
    assert (plugin.plugin_name, plugin.plugin_version, plugin.plugin_namespace) == (
        "DFlashTreeMask", "1", "dflash")
    # The layout the attention kernels read: ceil(49 / 32) = 2 words per row, offsets 49 wide.
    assert packed.shape == (-1, 2) and offsets.shape == (1, 49) and lengths_out.shape == (1,)
    assert [f.name for f in plugin.get_fields_to_serialize()] == ["max_nodes"]


def test_kv_compact_linear_takes_the_caches_as_inputs(network) -> None:
    trt, _ = network
    accepted = _input("accepted", trt.int32, [1, 4])
    num = _input("num", trt.int32, [1])
    past = _input("past", trt.int32, [1])
    caches = [_input(f"kv{i}", trt.bfloat16, [1, 2, 2, 128, 64]) for i in range(3)]
    committed = plugins.kv_compact_linear(accepted, num, past, caches, num_kv_heads=2, head_size=64,
                                          kv_cache_dtype="bfloat16")
    layer = committed.producer
    assert [layer.get_input(i).name for i in range(layer.num_inputs)] == ["accepted", "num", "past", "kv0", "kv1",
                                                                          "kv2"]
    values = {f.name: int(np.asarray(f.data).reshape(-1)[0]) for f in layer._record.plugin.get_fields_to_serialize()}
    assert values == {"layout": 0, "num_layers": 3, "num_kv_heads": 2, "head_size": 64, "elem_bytes": 2,
                      "tokens_per_block": 64}
    assert committed.dtype == trt.int32 and committed.shape == (1,)


def test_kv_compact_paged_takes_the_pool_tables(network) -> None:
    trt, _ = network
    names = ["accepted", "num_accepted", "past", "offsets", "pool_pointers", "pool_mapping"]
    shapes = [[1, 4], [1], [1], [1, 1, 2, 8], [1, 2], [4, 2]]
    dtypes = [trt.int32] * 4 + [trt.int64, trt.int32]
    tensors = [_input(n, d, s) for n, d, s in zip(names, dtypes, shapes)]
    committed = plugins.kv_compact_paged(*tensors, num_layers=4, num_kv_heads=2, head_size=64,
                                         kv_cache_dtype="bfloat16", tokens_per_block=16)
    layer = committed.producer
    assert [layer.get_input(i).name for i in range(layer.num_inputs)] == names


def test_wrong_cache_dtype_is_refused_when_inserted(network) -> None:
    """The creator's elem_bytes must match the caches' element size (getOutputDataTypes)."""
    trt, _ = network
    from _emu import EmulationError

    tensors = [_input(n, trt.int32, s) for n, s in (("a", [1, 4]), ("n", [1]), ("p", [1]))]
    caches = [_input("kv0", trt.float32, [1, 2, 2, 16, 64])]
    with pytest.raises(EmulationError, match="input 3 may not be float32"):
        plugins.kv_compact_linear(*tensors, caches, num_kv_heads=2, head_size=64, kv_cache_dtype="bfloat16")


def test_unregistered_creator_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the library (and so without creators), the error names the plugin and the failure to load."""
    with standin.active(tmp_path / "lib"):
        from tensorrt_llm.builder import Builder
        from tensorrt_llm.network import net_guard

        monkeypatch.setenv(plugins.PLUGIN_LIBRARY_ENV_VAR, str(tmp_path / "missing.so"))
        monkeypatch.setattr(plugins, "plugin_library_candidates", lambda: [tmp_path / "missing.so"])
        with net_guard(Builder().create_network()):
            import tensorrt as trt

            parents = _input("parents", trt.int32, [1, -1])
            lengths = _input("lengths", trt.int32, [1])
            with pytest.raises(RuntimeError, match="TensorRT has no creator dflash::DFlashTreeMask v1"):
                plugins.tree_mask(parents, lengths)


def test_init_function_registers_once_per_namespace(tmp_path: Path) -> None:
    """The contract initDFlashPlugins has in C++ (plugin_registration.cpp; host test) and in the
    stand-in library: same namespace again -> true, another namespace -> false."""
    with standin.active(tmp_path / "lib"):
        from _emu.dflash_plugins import build_standin_library

        library = ctypes.CDLL(str(build_standin_library(tmp_path / "lib2")))
        init = library.initDFlashPlugins
        init.restype, init.argtypes = ctypes.c_bool, [ctypes.c_void_p, ctypes.c_char_p]
        assert init(None, b"dflash") and init(None, b"dflash") and not init(None, b"other")
