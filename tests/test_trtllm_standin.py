"""The stand-in held to the real API: tests/trtllm_standin/manifest.json.

Every entry of the manifest is one TensorRT-LLM 1.2.1 or TensorRT 10.14 symbol as read in its
upstream source (file and 40-hex commit): kind and parameters (names, kinds, defaults as source
text), members for enums. Here:

* every entry is pinned (source path and commit) and well formed;
* every symbol the stand-in defines publicly has an entry, and matches it: same kind, same
  parameter names in the same order with the same kinds and defaults; a name upstream does
  not have (``kind: absent``) is not defined;
* every ``tensorrt_llm`` / ``tensorrt`` name this package uses is in the manifest and in the
  stand-in, so the engine code only ever runs against pinned signatures.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import inspect
import json
import pkgutil
import re
import textwrap
from pathlib import Path

import pytest
import standin

ROOT = Path(__file__).resolve().parents[1]
STANDIN = ROOT / "tests" / "trtllm_standin"
MANIFEST = json.loads((STANDIN / "manifest.json").read_text())
BY_SYMBOL = {e["symbol"]: e for e in MANIFEST}
COMMIT = re.compile(r"^[0-9a-f]{40}$")
KINDS = {"class", "function", "method", "property", "staticmethod", "classmethod", "enum", "attribute", "module",
         "absent"}

#: Stand-in names that exist only to emulate (no upstream counterpart); nothing in the package uses them.
EMULATION_ONLY = {
    "tensorrt.EmulationError": "raised where TensorRT or the GPU would fail (build error, failed enqueue)",
    "tensorrt.physical_dtype": "storage dtype of a declared TensorRT dtype under the chosen numerics",
}


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """The stand-in's modules, imported once inside an active stand-in."""
    with standin.active(tmp_path_factory.mktemp("lib")):
        import tensorrt
        import tensorrt_llm

        modules = {"tensorrt": tensorrt, "tensorrt_llm": tensorrt_llm}
        for info in pkgutil.walk_packages(tensorrt_llm.__path__, "tensorrt_llm."):
            modules[info.name] = importlib.import_module(info.name)
        yield modules


def resolve(api: dict, symbol: str):
    """(owner, name, object) for a dotted symbol, or None when the stand-in lacks it."""
    parts = symbol.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = api.get(".".join(parts[:cut]))
        if module is None:
            continue
        owner, obj = module, module
        for name in parts[cut:]:
            owner = obj
            obj = inspect.getattr_static(obj, name, _MISSING) if inspect.isclass(obj) else getattr(obj, name, _MISSING)
            if obj is _MISSING:
                return None
        return owner, parts[-1], obj
    return None


_MISSING = object()


def kind_of(owner, obj) -> str:
    if inspect.ismodule(obj):
        return "module"
    if inspect.isclass(obj):
        return "enum" if issubclass(obj, enum.Enum) else "class"
    if isinstance(obj, property):
        return "property"
    if isinstance(obj, staticmethod):
        return "staticmethod"
    if isinstance(obj, classmethod):
        return "classmethod"
    if callable(obj):
        return "method" if inspect.isclass(owner) else "function"
    return "attribute"


def _function(obj):
    if isinstance(obj, (staticmethod, classmethod)):
        return obj.__func__
    if inspect.isclass(obj):
        return obj.__init__ if "__init__" in vars(obj) else None
    return obj


def _default_texts(func) -> dict[str, str]:
    """Parameter -> default as source text, from the stand-in's own source."""
    try:
        source = textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError):
        return {}
    node = ast.parse(source).body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return {}
    args = node.args
    positional = args.posonlyargs + args.args
    texts = {a.arg: ast.unparse(d) for a, d in zip(positional[len(positional) - len(args.defaults):], args.defaults)}
    texts.update({a.arg: ast.unparse(d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None})
    return texts


def _dataclass_default_texts(cls) -> dict[str, str]:
    """A dataclass's generated __init__ has no source: the defaults as the class body writes
    them, and a default_factory field as "Factory()" (the manifest's spelling)."""
    texts = {}
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    for statement in node.body:
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) and statement.value:
            texts[statement.target.id] = ast.unparse(statement.value)
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING:
            texts[f.name] = f"{f.default_factory.__name__}()"
    return texts


def _normal(text: str | None) -> str | None:
    if text is None:
        return None
    try:
        return ast.unparse(ast.parse(text, mode="eval"))
    except SyntaxError:
        return text


def standin_params(owner, obj) -> list[dict] | None:
    func = _function(obj)
    if func is None:
        return []
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return None
    texts = _default_texts(func)
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        texts.update(_dataclass_default_texts(obj))
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls") and (inspect.isclass(obj) or kind_of(owner, obj) in
                                                          ("method", "classmethod", "property")):
        params = params[1:]
    return [{"name": p.name, "kind": p.kind.name, "has_default": p.default is not inspect.Parameter.empty,
             "default": texts.get(p.name, None if p.default is inspect.Parameter.empty else repr(p.default)),
             "value": p.default}
            for p in params]


def defaults_agree(expected: str | None, got: dict, namespace: dict) -> bool:
    """Same source text, or the manifest's text evaluates (in the stand-in's namespace) to the
    stand-in's default value (a functools.partial keyword has a value but no text)."""
    if _normal(expected) == _normal(got["default"]):
        return True
    try:
        return eval(expected, namespace) == got["value"]  # noqa: S307 - manifest text only
    except Exception:  # noqa: BLE001 - not evaluable here: the texts decide
        return False


def param_mismatches(entry: dict, params: list[dict], namespace: dict) -> list[str]:
    expected, got = entry["params"], params
    problems = []
    if [p["name"] for p in expected] != [p["name"] for p in got]:
        return [f"parameters {[p['name'] for p in got]} != upstream {[p['name'] for p in expected]}"]
    for e, g in zip(expected, got):
        if e["kind"] != g["kind"]:
            problems.append(f"{e['name']}: kind {g['kind']} != {e['kind']}")
        if e["has_default"] != g["has_default"]:
            problems.append(f"{e['name']}: has_default {g['has_default']} != {e['has_default']}")
        elif e["has_default"] and not defaults_agree(e["default"], g, namespace):
            problems.append(f"{e['name']}: default {g['default']} != {e['default']}")
    return problems


def standin_public_symbols(api: dict) -> set[str]:
    """Public classes/functions (and their public members) the stand-in modules define."""
    found = set()
    for module_name, module in api.items():
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            symbol = f"{module_name}.{name}"
            found.add(symbol)
            if inspect.isclass(obj) and not issubclass(obj, enum.Enum):
                for member, value in vars(obj).items():
                    if member.startswith("_"):
                        continue
                    if isinstance(value, (property, staticmethod, classmethod)) or inspect.isfunction(value):
                        found.add(f"{symbol}.{member}")
    return found


# --------------------------------------------------------------------------------------------


def test_every_entry_is_pinned_and_well_formed():
    assert len(MANIFEST) == len(BY_SYMBOL), "duplicate symbols in the manifest"
    for entry in MANIFEST:
        symbol = entry["symbol"]
        assert symbol.split(".")[0] in ("tensorrt", "tensorrt_llm"), symbol
        assert entry["kind"] in KINDS, symbol
        assert COMMIT.match(entry.get("commit") or ""), f"{symbol}: no upstream commit"
        assert re.match(r"^[\w./-]+\.(py|cpp|h)$", entry["source"]), f"{symbol}: source {entry['source']!r}"
        for variant in entry.get("variants", []):
            assert variant.get("note"), f"{symbol}: a variant must say where it was read"
        for p in entry.get("params", []):
            assert set(p) >= {"name", "kind", "has_default", "default"}, symbol
            assert p["kind"] in [k.name for k in inspect._ParameterKind], (symbol, p)
    repos = {e["symbol"].split(".")[0]: set() for e in MANIFEST}
    for e in MANIFEST:
        repos[e["symbol"].split(".")[0]].add(e["commit"])
    assert repos["tensorrt"] == {"3b4ddc1d45f11167f2ea53dc6046bba8df800e2d"}  # NVIDIA/TensorRT v10.14


def _identity(api: dict, symbol: str):
    found = resolve(api, symbol)
    if found is None:
        return None
    owner, name, obj = found
    return (id(owner), name) if inspect.isclass(owner) else id(obj)


def test_every_standin_symbol_is_in_the_manifest(api):
    """Re-exports count once: ``tensorrt_llm.layers.linear.ColumnLinear`` is the pinned
    ``tensorrt_llm.layers.ColumnLinear``."""
    pinned = {_identity(api, e["symbol"]) for e in MANIFEST} - {None}
    unlisted = sorted(s for s in standin_public_symbols(api) - set(BY_SYMBOL) - set(EMULATION_ONLY)
                      if _identity(api, s) not in pinned)
    assert not unlisted, f"stand-in symbols without an upstream entry: {unlisted}"


def test_standin_matches_every_entry_it_implements(api):
    problems = []
    for entry in MANIFEST:
        found = resolve(api, entry["symbol"])
        if entry["kind"] == "absent":
            if found is not None:
                problems.append(f"{entry['symbol']}: defined, but upstream has no such name")
            continue
        if found is None:
            continue
        owner, _, obj = found
        kind = kind_of(owner, obj)
        expected_kind = entry["kind"]
        if expected_kind != kind and not (expected_kind == "attribute" and kind in ("class", "enum")):
            problems.append(f"{entry['symbol']}: {kind}, upstream {expected_kind}")
            continue
        if kind == "enum":
            members = entry.get("members") or []
            if isinstance(members, dict):
                members = [{"name": k, "value": v} for k, v in members.items()]
            for member in members:
                got = obj.__members__.get(member["name"])
                if got is None:
                    problems.append(f"{entry['symbol']}: member {member['name']} missing")
                elif isinstance(member.get("value"), int) and isinstance(got.value, int) and got.value != member["value"]:
                    problems.append(f"{entry['symbol']}.{member['name']} = {got.value}, upstream {member['value']}")
            continue
        if kind in ("property", "attribute") or expected_kind in ("attribute", "module"):
            continue
        if kind == "class" and entry.get("constructible") is False:
            continue  # no Python constructor upstream; the stand-in's own is internal
        params = standin_params(owner, obj)
        if params is None:
            problems.append(f"{entry['symbol']}: no signature")
            continue
        module = inspect.getmodule(_function(obj) or obj)
        namespace = {**vars(module), "trt": api["tensorrt"]} if module else {"trt": api["tensorrt"]}
        found_problems = param_mismatches(entry, params, namespace)
        # A newer stored copy the index gives no commit for (recorded under "variants", with the
        # pinned signature still the entry's own): the stand-in may follow either.
        if found_problems and any(not param_mismatches(v, params, namespace) for v in entry.get("variants", [])):
            found_problems = []
        problems += [f"{entry['symbol']}: {p}" for p in found_problems]
    assert not problems, "\n".join(problems)


def _package_usage() -> set[str]:
    """tensorrt_llm.* names imported, and trt.* attributes used, by tensorrt_llm_dflash."""
    used = set()
    for path in sorted((ROOT / "tensorrt_llm_dflash").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tensorrt_llm":
                used.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "trt":
                used.add(f"tensorrt.{node.attr}")
    return used


#: Members the package calls on objects it receives (Session, engine, context, registry, network,
#: layers, tensors): the attribute chains are not importable names, so they are listed here and
#: each must still be pinned in the manifest and present in the stand-in.
USED_MEMBERS = [
    "tensorrt.ICudaEngine.num_io_tensors", "tensorrt.ICudaEngine.get_tensor_name",
    "tensorrt.ICudaEngine.get_tensor_mode", "tensorrt.ICudaEngine.get_tensor_dtype",
    "tensorrt.ICudaEngine.num_optimization_profiles", "tensorrt.ICudaEngine.get_tensor_profile_shape",
    "tensorrt.IExecutionContext.active_optimization_profile",
    "tensorrt.IExecutionContext.set_optimization_profile_async", "tensorrt.IExecutionContext.set_input_shape",
    "tensorrt.IExecutionContext.get_tensor_shape", "tensorrt.IPluginRegistry.get_creator",
    "tensorrt.INetworkDefinition.add_plugin_v3", "tensorrt.ILayer.get_output",
    "tensorrt_llm.runtime.Session.from_serialized_engine", "tensorrt_llm.runtime.Session.run",
    "tensorrt_llm.runtime.Session.engine", "tensorrt_llm.runtime.Session.context",
    "tensorrt_llm.functional.Tensor.mark_output", "tensorrt_llm.parameter.Parameter.value",
    "tensorrt_llm.plugin.plugin.CustomAllReduceHelper.allocate_workspace",
    "tensorrt_llm.plugin.plugin.CustomAllReduceHelper.max_workspace_size_auto",
    "tensorrt_llm.models.generation_mixin.GenerationMixin.has_ctx_gen_opt_profiles",
    "tensorrt_llm.models.generation_mixin.GenerationMixin.get_profiles_ranges",
    "tensorrt_llm.models.modeling_utils.PretrainedModel.prepare_inputs",
    "tensorrt_llm.models.modeling_utils.DecoderModelForCausalLM.forward",
]


def test_everything_the_package_uses_is_pinned_and_emulated(api):
    used = _package_usage() | set(USED_MEMBERS)
    assert len(used) > 60
    unpinned = sorted(s for s in used if s not in BY_SYMBOL)
    assert not unpinned, f"used but not in the manifest: {unpinned}"
    missing = sorted(s for s in used if resolve(api, s) is None)
    assert not missing, f"used but not in the stand-in: {missing}"



# ------------------------------------------------------------------ TensorRT semantics


@pytest.fixture
def active(tmp_path):
    with standin.active(tmp_path / "lib", numerics="faithful"):  # declared dtypes are the storage dtypes
        yield


def _tiny_engine(dim_names=("batch", "hidden"), second_dims=("batch", "hidden"), location=None):
    """x [b, 4] float32 and y [b, 4] int32 -> out = x * 2 + cast(y), one profile b in 1..4."""
    from collections import OrderedDict

    import tensorrt as trt
    from tensorrt_llm.builder import Builder
    from tensorrt_llm.functional import Tensor, cast
    from tensorrt_llm.network import net_guard

    builder = Builder()
    network = builder.create_network()
    with net_guard(network):
        x = Tensor(name="x", dtype=trt.float32, shape=[-1, 4],
                   dim_range=OrderedDict([(dim_names[0], [(1, 2, 4)]), (dim_names[1], [4])]))
        kwargs = {} if location is None else {"location": location}
        y = Tensor(name="y", dtype=trt.int32, shape=[-1, 4],
                   dim_range=OrderedDict([(second_dims[0], [(1, 2, 3)]), (second_dims[1], [4])]), **kwargs)
        out = x * 2.0 + cast(y, "float32")
        out.mark_output("out", trt.float32)
    config = builder.create_builder_config(precision="float32")
    return builder, network, config


def _session(engine_bytes):
    from tensorrt_llm.runtime import Session

    return Session.from_serialized_engine(engine_bytes)


def test_session_runs_and_refuses_what_tensorrt_would(active):
    import torch
    from _emu import EmulationError

    builder, network, config = _tiny_engine(second_dims=("batch2", "hidden"))
    session = _session(builder.build_engine(network, config))
    x, y = torch.arange(8.0).view(2, 4), torch.ones(2, 4, dtype=torch.int32)
    for name, t in (("x", x), ("y", y)):
        assert session.context.set_input_shape(name, tuple(t.shape))
    out = torch.empty(2, 4)
    # (before any run: TensorRT keeps a context's addresses from one run to the next)
    with pytest.raises(EmulationError, match="no address set for input 'y'"):
        session.run({"x": x}, {"out": out}, 0)
    assert session.run({"x": x, "y": y}, {"out": out}, 0)
    assert torch.equal(out, x * 2 + 1)
    with pytest.raises(EmulationError, match="invalid tensor name 'z'"):
        session.run({"x": x, "y": y, "z": y}, {"out": out}, 0)
    with pytest.raises(EmulationError, match="'y' is bound as torch.float32, the engine reads torch.int32"):
        session.run({"x": x, "y": y.float()}, {"out": out}, 0)
    assert not session.context.set_input_shape("x", (5, 4))  # the profile allows 1..4
    assert not session.context.set_input_shape("x", (2, 4, 1))
    with pytest.raises(ValueError, match="Couldn't assign y with shape"):
        session.set_shapes({"x": x, "y": torch.ones(4, 4, dtype=torch.int32)})  # y's own range is 1..3


def test_named_dimensions_must_agree(active):
    """Builder._validate_named_dimensions (tensorrt_llm/builder.py): one name, one range."""
    builder, network, config = _tiny_engine(second_dims=("batch", "hidden"))  # "batch" is 1..4 and 1..3
    assert builder._validate_named_dimensions(network, config) is False
    builder, network, config = _tiny_engine(second_dims=("batch2", "hidden"))
    assert builder._validate_named_dimensions(network, config) is True


def test_host_location_is_refused_when_built(active):
    import tensorrt as trt
    from _emu import EmulationError

    with pytest.warns(DeprecationWarning, match="deprecated since TensorRT 10.0"):
        builder, network, config = _tiny_engine(second_dims=("batch2", "hidden"), location=trt.TensorLocation.HOST)
    with pytest.raises(EmulationError, match="input 'y': the location must always be kDEVICE"):
        builder.build_engine(network, config)


def test_functional_semantics_differ_from_torch_where_tensorrt_does(active):
    """gather is GatherElements, concat takes Python ints, element-wise ops are strongly typed
    (int32 meets int64 only through the explicit reconciliation functional does), and a read
    outside every live allocation is a fault, not garbage."""
    from collections import OrderedDict

    import numpy as np
    import tensorrt as trt
    import torch
    from _emu import EmulatedMemoryFault, EmulationError, device_memory
    from tensorrt_llm.builder import Builder
    from tensorrt_llm.functional import Tensor, concat, constant, gather, shape
    from tensorrt_llm.network import net_guard

    builder = Builder()
    network = builder.create_network()
    with net_guard(network):
        x = Tensor(name="x", dtype=trt.float32, shape=[2, 3], dim_range=OrderedDict([("r", [2]), ("c", [3])]))
        index = constant(np.array([[2, 0], [1, 1]], dtype=np.int32))
        gathered = gather(x, 1, index)  # GatherElements: out[i][j] = x[i][index[i][j]]
        gathered.mark_output("gathered", trt.float32)
        dims = concat([shape(x, 0), 7])  # a shape tensor with a Python int in it
        dims.mark_output("dims", trt.int32)
        with pytest.raises(EmulationError, match="input types differ"):
            _ = x + constant(np.ones((2, 3), dtype=np.float16))
    session = _session(builder.build_engine(network, builder.create_builder_config(precision="float32")))
    x_value = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert session.context.set_input_shape("x", (2, 3))
    outs = {"gathered": torch.empty(2, 2), "dims": torch.empty(2, dtype=torch.int32)}
    session.run({"x": x_value}, outs, 0)
    assert outs["gathered"].tolist() == [[3.0, 1.0], [5.0, 5.0]]
    assert outs["dims"].tolist() == [2, 7]
    with pytest.raises(EmulatedMemoryFault, match="illegal memory access"):
        device_memory.view(16, (4,), torch.float32)
