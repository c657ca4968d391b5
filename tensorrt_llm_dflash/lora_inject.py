"""The LoRA direct-injection drafter: the target's own layers plus peft LoRA adapters.

At every layer l the drafter's input is ``cat(target_ctx[l], draft_hidden)``: the target's
own layer-l input for the committed context, then the block ``[bonus, MASK x (B-1)]`` at
positions ``start .. start+B-1``. The block sees all the context and all of the block;
only the block part of a layer's output goes on to layer l+1, where the context is again
the target's own layer-(l+1) input. Logits are the target's final norm + lm_head on block
positions 1..B-1. No fc/hidden_norm fusion, and no draft KV cache of its own.

Why the context needs no computation at all: context rows' outputs are thrown away, so a
context token only matters through its K/V at each layer. With LoRA only on q_proj,
o_proj and the MLP (never k_proj/v_proj), context K/V at layer l are
``rope(k_norm?(k_proj(input_layernorm(target_ctx[l]))))`` and ``v_proj(...)`` with frozen,
shared weights: exactly what the target already holds in its KV cache for those tokens.
So :class:`LoRAInjectProposer` reads them from the verifier's cache (``context="cache"``).
If an adapter does touch k_proj/v_proj, that identity fails and the proposer must
recompute (``context="layer_inputs"``): it then receives every layer's input as features
and runs each layer on ``cat(ctx, block)``, the literal definition. docs/lora_inject.md.

Each draft layer is the target's HF decoder layer class, rebuilt around the target's own
weight modules (shared, never copied) so peft can wrap them without touching the target;
the layer's attention gets the context K/V through a read-only cache view.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .compat import CACHE_KWARG
from .decode import stop_ids
from .draft_head import DraftHead
from .errors import DFlashConfigError
from .files import unpacked
from .target import HFTargetVerifier

CONFIG_NAME = "dflash_lora_inject.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: Optional reduced draft vocabulary (target ids the proposer scores): the lm_head read dominates drafting.
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
#: Queries, attention output and MLP: context K/V then stay identical to the target's cache.
DEFAULT_LORA_TARGETS = ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Projections whose adaptation changes context K/V, which rules out reading the target's cache.
KV_PROJECTIONS = ("k_proj", "v_proj")
#: Target config fields an adapter checkpoint must agree with.
MATCHED_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
                  "num_key_value_heads", "intermediate_size")


# ---------------------------------------------------------------------------- config


@dataclass
class LoRAInjectConfig:
    """Contents of ``dflash_lora_inject.json``: the target it was trained for, the block, the adapters."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    block_size: int
    mask_token_id: int
    lora_target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))
    lora_rank: int = 16
    lora_alpha: float = 32.0
    #: Size of the reduced draft vocabulary in draft_vocab.safetensors; None scores the full vocabulary.
    draft_vocab_size: int | None = None
    format: str = "dflash-lora-inject-v1"

    @classmethod
    def for_target(cls, model: Any, block_size: int, mask_token_id: int, **lora: Any) -> LoRAInjectConfig:
        c = model.config
        config = cls(
            model_type=str(c.model_type), hidden_size=int(c.hidden_size), num_hidden_layers=int(c.num_hidden_layers),
            vocab_size=int(c.vocab_size), num_attention_heads=int(c.num_attention_heads),
            num_key_value_heads=int(getattr(c, "num_key_value_heads", c.num_attention_heads)),
            intermediate_size=int(c.intermediate_size), block_size=block_size, mask_token_id=mask_token_id, **lora,
        )
        config.check_target(model)
        return config

    def check_target(self, model: Any) -> None:
        """Raise DFlashConfigError naming the first field where ``model`` differs from this config."""
        c = model.config
        for name in MATCHED_FIELDS:
            want = getattr(self, name)
            have = getattr(c, name, None)
            if name == "num_key_value_heads" and have is None:
                have = c.num_attention_heads
            if have != want:
                raise DFlashConfigError(
                    f"{CONFIG_NAME}: {name}={want!r} but the target has {name}={have!r}; "
                    "this adapter was trained for another target"
                )
        rows = int(model.get_input_embeddings().weight.shape[0])
        if not 0 <= self.mask_token_id < rows:
            raise DFlashConfigError(f"{CONFIG_NAME}: mask_token_id={self.mask_token_id} is outside the target's "
                                    f"embedding rows 0..{rows - 1}")
        if self.block_size < 2:
            raise DFlashConfigError(f"{CONFIG_NAME}: block_size={self.block_size} must be at least 2")
        if "sliding_attention" in (getattr(c, "layer_types", None) or []):
            raise DFlashConfigError(
                f"the target's layer_types={list(c.layer_types)} include sliding_attention: a sliding-window "
                "KV cache drops old context, which this drafter does not handle yet"
            )

    @property
    def adapts_kv(self) -> bool:
        return any(name in KV_PROJECTIONS for name in self.lora_target_modules)

    def save(self, path: Path) -> None:
        (path / CONFIG_NAME).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> LoRAInjectConfig:
        file = path / CONFIG_NAME
        if not file.is_file():
            raise DFlashConfigError(f"{str(path)!r} has no {CONFIG_NAME}: not a LoRA-inject drafter directory")
        raw = json.loads(file.read_text())
        known = set(cls.__dataclass_fields__)
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in required if name not in raw]
        if missing:
            raise DFlashConfigError(f"{CONFIG_NAME} lacks the fields {missing}")
        return cls(**{k: v for k, v in raw.items() if k in known})


# ------------------------------------------------------------------ the draft layers


def _mirror_layer(layer: nn.Module) -> nn.Module:
    """A new decoder layer of the same class whose weight-holding submodules ARE the target's.

    The containers are fresh (built on the meta device, so nothing is allocated), hence
    peft can replace ``q_proj`` in the mirror while the target keeps its plain Linear, and
    hooks registered on the target's layers (feature capture) never fire for the drafter.
    """
    attn = layer.self_attn
    with torch.device("meta"):
        mirror = type(layer)(attn.config, attn.layer_idx)
    for name, module in layer.named_modules():
        if name and (module._parameters or module._buffers):
            mirror.set_submodule(name, module)
    left = [n for n, t in [*mirror.named_parameters(), *mirror.named_buffers()] if t.is_meta]
    if left:
        raise DFlashConfigError(f"cannot mirror target layer {type(layer).__name__}: unshared tensors {left}")
    return mirror


class _TargetMirror(nn.Module):
    """Same module names as the HF causal LM (``model.layers.N.self_attn.q_proj``), so the
    saved adapter's tensor names are those of a peft adapter on the target itself."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(layers)


@dataclass
class ContextKV:
    """Per-layer context keys/values [b, kv_heads, S, head_dim] (RoPE applied), as a KV cache holds them."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[2]) if self.keys else 0

    @classmethod
    def from_cache(cls, cache: Any, length: int | None = None) -> ContextKV:
        """The first ``length`` positions of a transformers DynamicCache (all of it by default)."""
        keys, values = [], []
        for layer in cache.layers:
            n = layer.keys.shape[2] if length is None else length
            keys.append(layer.keys[:, :, :n])
            values.append(layer.values[:, :, :n])
        return cls(keys, values)


class _ContextView:
    """Stands in for the KV cache inside an HF attention layer: the block's K/V are appended to
    the context's for this call only (the draft block is never stored)."""

    def __init__(self, context: ContextKV) -> None:
        self.context = context

    # The rest of the call differs by release (4.57: cache_kwargs; 5.2x: kwargs=...) and is not needed here.
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.context.keys[layer_idx], self.context.values[layer_idx]
        return torch.cat([k.to(key_states.dtype), key_states], 2), torch.cat([v.to(value_states.dtype), value_states], 2)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool visibility [b, Q, K] -> additive [b, 1, Q, K] (eager attention adds it; sdpa accepts it)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def injection_mask(block_allowed: torch.Tensor) -> torch.Tensor:
    """Visibility [b, S+Q, S+Q] for a layer run on ``cat(ctx, block)``: the context is causal among
    itself (as in the target) and never sees the block; block rows follow ``block_allowed`` [b, Q, S+Q]."""
    b, q, total = block_allowed.shape
    s = total - q
    ctx = torch.zeros(b, s, total, dtype=torch.bool, device=block_allowed.device)
    ctx[:, :, :s] = torch.ones(s, s, dtype=torch.bool, device=block_allowed.device).tril()
    return torch.cat([ctx, block_allowed], dim=1)


class DFlashLoRAInjectDraftModel(nn.Module):
    """The target's decoder layers with peft LoRA adapters, drafting a block against injected context.

    Registered parameters: the peft-wrapped mirror of the target's layers (whose base weights
    are the target's own tensors, frozen). The embedding, final norm, rotary embedding and
    lm_head are the target's and are kept outside the module tree, so ``.to()`` or
    ``state_dict()`` of the drafter never reach them. ``state_dict`` holds the adapters only.
    """

    def __init__(self, target: Any, config: LoRAInjectConfig, lora_dropout: float = 0.0) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model

        config.check_target(target)
        self.config = config
        decoder = target.get_decoder()
        mirror = _TargetMirror([_mirror_layer(layer) for layer in decoder.layers])
        lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=lora_dropout,
                          target_modules=list(config.lora_target_modules), bias="none")
        self.adapted = get_peft_model(mirror, lora)
        # Not registered: shared with the target, frozen, and never cast or saved with the drafter.
        object.__setattr__(self, "_shared", {
            "embed": target.get_input_embeddings(), "norm": decoder.norm, "rotary": decoder.rotary_emb,
            "lm_head": target.get_output_embeddings(),
        })
        for module in self._shared.values():
            for p in module.parameters():
                p.requires_grad_(False)
        param = target.get_input_embeddings().weight
        self.dtype, self.device = param.dtype, param.device
        self.draft_ids: torch.Tensor | None = None  # sorted target ids of the reduced draft vocabulary

    def set_draft_vocab(self, token_ids: Sequence[int] | torch.Tensor | None) -> None:
        """Restrict drafting (not training) to these target ids; None restores the full vocabulary."""
        if token_ids is None:
            self.draft_ids, self.config.draft_vocab_size = None, None
            return
        ids = torch.unique(torch.as_tensor(token_ids, dtype=torch.long).cpu())  # sorted
        vocab = int(self.lm_head_weight.shape[0])
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= vocab:
            raise DFlashConfigError(f"draft vocabulary ids must be non-empty and within 0..{vocab - 1}")
        self.draft_ids, self.config.draft_vocab_size = ids.to(self.device), int(ids.numel())

    # -------------------------------------------------------------- structure / state

    @property
    def layers(self) -> nn.ModuleList:
        return self.adapted.base_model.model.model.layers

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self._shared["lm_head"].weight

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """LoRA tensors under peft's saved names (``base_model.model.model.layers.N...lora_A.weight``)."""
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self.adapted)

    def load_adapter_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        expected = set(self.adapter_state_dict())
        missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        if missing or unexpected:
            raise DFlashConfigError(f"adapter weights do not match {CONFIG_NAME}: missing {missing[:4]}"
                                    f"{' ...' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}"
                                    f"{' ...' if len(unexpected) > 4 else ''}")
        mine = self.adapter_state_dict()
        for name, tensor in tensors.items():
            if tuple(tensor.shape) != tuple(mine[name].shape):
                raise DFlashConfigError(f"adapter tensor {name} has shape {tuple(tensor.shape)}, "
                                        f"{CONFIG_NAME} implies {tuple(mine[name].shape)}")
        set_peft_model_state_dict(self.adapted, {k: v.to(self.dtype) for k, v in tensors.items()})

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        # Training checkpoints hold the adapters only: the base weights are the target's.
        return {k: v.detach().clone() for k, v in self.adapter_state_dict().items()}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True, assign: bool = False):  # type: ignore[override]
        self.load_adapter_state_dict(dict(state_dict))

    def lora_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.adapted.named_parameters() if "lora_" in n]

    def randomize_adapters_(self, std: float, generator: torch.Generator | None = None) -> None:
        """Nonzero A and B (peft starts B at zero), for tests whose drafts must differ from the target's."""
        with torch.no_grad():
            for p in self.lora_parameters():
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64).to(p.dtype) * std)

    # -------------------------------------------------------------------- forward

    def embed_blocks(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """[b, N] anchor (bonus) tokens -> embeddings [b, N*B, H] of blocks ``[anchor, MASK x (B-1)]``."""
        b, n = anchor_tokens.shape
        ids = torch.full((b, n, self.config.block_size), self.config.mask_token_id, dtype=torch.long,
                         device=anchor_tokens.device)
        ids[:, :, 0] = anchor_tokens
        return self._shared["embed"](ids.view(b, -1))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._shared["rotary"](x, positions)

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        context: ContextKV,
        block_allowed: torch.Tensor | None = None,
        return_layer_outputs: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Block hidden states after the final norm, [b, Q, H], with the context given as per-layer K/V.

        ``block_allowed`` [b, Q, S+Q] (bool) restricts what each block query sees (training keeps
        blocks apart); None is the inference rule: all context and the whole block.
        """
        x = block_embeds
        b, q, _ = x.shape
        if block_allowed is None:
            block_allowed = torch.ones(b, q, context.length + q, dtype=torch.bool, device=x.device)
        mask = additive_mask(block_allowed, x.dtype)
        rope = self._rope(x, block_positions)
        view = _ContextView(context)
        outputs = []
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_embeddings=rope, **{CACHE_KWARG: view})
            outputs.append(x)
        out = self._shared["norm"](x)
        return (out, outputs) if return_layer_outputs else out

    def forward_injected(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        layer_inputs: Sequence[torch.Tensor],
        context_positions: torch.Tensor,
        block_allowed: torch.Tensor | None = None,
        return_layer_outputs: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """The literal definition: layer l runs on ``cat(layer_inputs[l], x)`` [b, S+Q, H] under
        :func:`injection_mask`, and only the block rows go on. Valid for any adapter placement."""
        x = block_embeds
        b, q, _ = x.shape
        s = int(context_positions.shape[1])
        if block_allowed is None:
            block_allowed = torch.ones(b, q, s + q, dtype=torch.bool, device=x.device)
        mask = additive_mask(injection_mask(block_allowed), x.dtype)
        rope = self._rope(x, torch.cat([context_positions, block_positions], 1))
        outputs = []
        for layer, ctx in zip(self.layers, layer_inputs):
            x = layer(torch.cat([ctx.to(x.dtype), x], 1), attention_mask=mask, position_embeddings=rope)[:, s:]
            outputs.append(x)
        out = self._shared["norm"](x)
        return (out, outputs) if return_layer_outputs else out

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target lm_head on normed hidden states [..., H] -> [..., V] (a 2-D matmul: see training/model.py)."""
        w = self.lm_head_weight
        return (hidden.reshape(-1, hidden.shape[-1]).to(w.dtype) @ w.T).view(*hidden.shape[:-1], w.shape[0])

    # --------------------------------------------------------------------- save/load

    def save_pretrained(self, path: str | Path) -> None:
        """peft adapter (adapter_config.json + adapter_model.safetensors) plus ``dflash_lora_inject.json``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.adapted.save_pretrained(str(path))
        self.config.save(path)
        if self.draft_ids is not None:
            from safetensors.torch import save_file

            save_file({"draft_ids": self.draft_ids.cpu().contiguous()}, str(path / DRAFT_VOCAB_FILE))

    @classmethod
    def from_pretrained(cls, target: Any, path: str | Path) -> DFlashLoRAInjectDraftModel:
        """Load onto ``target``; DFlashConfigError names the field when the target does not match."""
        from peft import LoraConfig
        from safetensors.torch import load_file

        if not Path(path).is_dir():
            raise DFlashConfigError(f"draft_model_dir={str(path)!r} is not a directory")
        path = unpacked(path)  # the shipped adapter's weights are xz-packed
        config = LoRAInjectConfig.load(path)
        config.check_target(target)
        if not (path / "adapter_config.json").is_file() or not (path / ADAPTER_WEIGHTS).is_file():
            raise DFlashConfigError(f"{str(path)!r} lacks the peft adapter (adapter_config.json, {ADAPTER_WEIGHTS})")
        lora = LoraConfig.from_pretrained(str(path))
        peft_targets = sorted(lora.target_modules) if not isinstance(lora.target_modules, str) else [lora.target_modules]
        if peft_targets != sorted(config.lora_target_modules):
            raise DFlashConfigError(f"adapter_config.json target_modules={peft_targets} but {CONFIG_NAME} "
                                    f"lora_target_modules={sorted(config.lora_target_modules)}")
        if lora.r != config.lora_rank:
            raise DFlashConfigError(f"adapter_config.json r={lora.r} but {CONFIG_NAME} lora_rank={config.lora_rank}")
        model = cls(target, config)
        model.load_adapter_state_dict(load_file(str(path / ADAPTER_WEIGHTS)))
        if config.draft_vocab_size is not None:
            file = path / DRAFT_VOCAB_FILE
            if not file.is_file():
                raise DFlashConfigError(f"{CONFIG_NAME} draft_vocab_size={config.draft_vocab_size} but {str(path)!r} "
                                        f"has no {DRAFT_VOCAB_FILE}")
            ids = load_file(str(file))["draft_ids"]
            if ids.numel() != config.draft_vocab_size:
                raise DFlashConfigError(f"{DRAFT_VOCAB_FILE} holds {ids.numel()} ids but {CONFIG_NAME} "
                                        f"draft_vocab_size={config.draft_vocab_size}")
            model.set_draft_vocab(ids)
        return model.eval()


# -------------------------------------------------------------------- the runtime


class LayerInputVerifier(HFTargetVerifier):
    """An HFTargetVerifier whose features are every decoder layer's INPUT, concatenated: [n, L*H].

    Layer 0's input is the embedding output (hooked on the embedding); layer l>0's is layer
    l-1's output (the base class's capture). Needed only when adapters touch k_proj/v_proj.
    """

    def __init__(self, model: Any) -> None:
        num_layers = len(model.get_decoder().layers)
        super().__init__(model, list(range(num_layers - 1)))
        self.layer_ids = [-1, *range(num_layers - 1)]
        embed = model.get_input_embeddings()
        self._hooks.append(embed.register_forward_hook(lambda _m, _i, out: self._captured.__setitem__(-1, out)))


class LoRAInjectProposer:
    """DraftProposer for the LoRA-inject drafter (decode.DraftProposer protocol).

    ``context="cache"``: context K/V are read from the bound verifier's KV cache (valid only if
    no adapter is on k_proj/v_proj); the features the loop passes are not needed. ``context=
    "layer_inputs"``: features are every layer's input (:class:`LayerInputVerifier`), kept in a
    growing buffer and injected by recomputing each layer on ``cat(ctx, block)`` every step.
    """

    target_layer_ids: list[int] = []  # the bench harness asks; this proposer reads no captured layers

    def __init__(self, model: DFlashLoRAInjectDraftModel, context: str = "cache") -> None:
        if context not in ("cache", "layer_inputs"):
            raise DFlashConfigError(f"context={context!r} must be 'cache' or 'layer_inputs'")
        if context == "cache" and model.config.adapts_kv:
            raise DFlashConfigError(
                f"lora_target_modules={model.config.lora_target_modules} adapt k_proj/v_proj, so context K/V "
                "differ from the target's cache: use context='layer_inputs'"
            )
        self.model = model
        self.context = context
        self.block_size = model.config.block_size
        self.vocab_size = int(model.lm_head_weight.shape[0])
        # Scoring only the draft vocabulary reads a fraction of the lm_head (a copy of those rows).
        ids = model.draft_ids
        self.head = DraftHead(model.lm_head_weight if ids is None else model.lm_head_weight.index_select(0, ids))
        self.verifier: HFTargetVerifier | None = None
        self.reset()

    def bind(self, verifier: HFTargetVerifier) -> LoRAInjectProposer:
        """The verifier whose KV cache holds the context (context='cache')."""
        self.verifier = verifier
        return self

    def reset(self) -> None:
        self.layer_inputs: torch.Tensor | None = None  # [S, L*H] (context='layer_inputs')
        self.steps = 0

    def _context(self) -> tuple[ContextKV | None, int]:
        if self.context == "cache":
            if self.verifier is None or self.verifier.cache is None:
                raise DFlashConfigError("LoRAInjectProposer(context='cache') is not bound to a verifier: call bind()")
            past = self.verifier.past_len
            return ContextKV.from_cache(self.verifier.cache, past), past
        return None, int(self.layer_inputs.shape[0])

    @torch.inference_mode()
    def propose(self, root_token: int, new_context: torch.Tensor | None) -> torch.Tensor:
        """Logits [block_size - 1, V] for the positions after ``root_token``."""
        m = self.model
        if self.context == "layer_inputs":
            if new_context is None:
                raise DFlashConfigError("context='layer_inputs' needs a LayerInputVerifier (features are layer inputs)")
            rows = new_context.to(m.device, m.dtype)
            self.layer_inputs = rows if self.layer_inputs is None else torch.cat([self.layer_inputs, rows])
        ctx, past = self._context()
        self.steps += 1
        embeds = m.embed_blocks(torch.tensor([[root_token]], device=m.device))
        positions = torch.arange(past, past + self.block_size, device=m.device)[None]
        if ctx is not None:
            hidden = m(embeds, positions, ctx)
        else:
            per_layer = list(self.layer_inputs[None].split(m.config.hidden_size, dim=-1))
            hidden = m.forward_injected(embeds, positions, per_layer, torch.arange(past, device=m.device)[None])
        logits = self.head(hidden[0, 1:])
        if m.draft_ids is None:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, m.draft_ids, logits)


def build_verifier(model: Any, proposer: LoRAInjectProposer) -> HFTargetVerifier:
    """The verifier a proposer needs (plain for 'cache', all layer inputs for 'layer_inputs'), bound to it."""
    verifier = HFTargetVerifier(model, []) if proposer.context == "cache" else LayerInputVerifier(model)
    proposer.bind(verifier)
    return verifier


def build_lora_inject_proposer(
    model: Any, draft_dir: str | Path, context: str = "auto"
) -> tuple[HFTargetVerifier, LoRAInjectProposer]:
    """(verifier, proposer) for ``examples/run.py --draft_type lora_inject --draft_model_dir DIR``.

    ``context='auto'`` reads the target's KV cache when the adapters allow it, else recomputes.
    """
    drafter = DFlashLoRAInjectDraftModel.from_pretrained(model, draft_dir)
    if context == "auto":
        context = "layer_inputs" if drafter.config.adapts_kv else "cache"
    proposer = LoRAInjectProposer(drafter, context)
    return build_verifier(model, proposer), proposer


# ------------------------------------------------------------------ examples/run.py

#: Shipped adapter for the embedded SmolLM2-135M-Instruct target (if this checkout has one).
SHIPPED_DRAFTER_DIR = Path(__file__).resolve().parent / "assets" / "smollm2-135m-instruct-lora-inject"
TRAIN_COMMAND = ("python examples/train_dflash_lora_inject.py --data_dir /work/runs/smollm2/data "
                 "--work_dir /work/runs/lora_inject --output_dir /work/runs/lora_inject/drafter --train_minutes 25")
#: DDTree budget when run.py gets none (see docs/lora_inject.md, "Measured").
DEFAULT_DDTREE_BUDGET = 16


def shipped_drafter_dir() -> Path | None:
    return SHIPPED_DRAFTER_DIR if (SHIPPED_DRAFTER_DIR / CONFIG_NAME).is_file() else None


def build_run_pytorch(args: Any) -> tuple[HFTargetVerifier, LoRAInjectProposer | None, Any, list[int], int]:
    """``examples/run.py --draft_type lora_inject``: the same 5-tuple as run.py's ``build_pytorch``
    (verifier, proposer or None, tokenizer, stop ids, default DDTree budget)."""
    from .errors import DFlashError
    from .target import load_target

    dtype = getattr(torch, args.dtype)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    draft_dir = args.draft_model_dir
    if args.speculative_decoding_mode != "none" and draft_dir is None:
        draft_dir = shipped_drafter_dir() if args.target_model_dir is None else None
        if draft_dir is None:
            raise DFlashError("--draft_type lora_inject needs --draft_model_dir (a LoRA-inject adapter dir); "
                              "train one with:\n  " + TRAIN_COMMAND)
    model, tokenizer = load_target(args.target_model_dir, dtype=dtype, device=device)
    if args.speculative_decoding_mode == "none":
        verifier, proposer = HFTargetVerifier(model, []), None
    else:
        verifier, proposer = build_lora_inject_proposer(model, draft_dir)
    return verifier, proposer, tokenizer, stop_ids(model.generation_config.eos_token_id), DEFAULT_DDTREE_BUDGET
