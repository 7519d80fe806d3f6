"""Finding the decoder layers (and their attention modules) of a causal LM."""

from __future__ import annotations

from torch import nn

from actmap.errors import ActmapUserError


class UnknownModelLayout(ActmapUserError):
    """actmap does not know where this model keeps its decoder layers."""


# Attribute paths of the decoder-layer list, tried in order. Covers Llama, Mistral,
# Qwen2/3, Gemma/Gemma2/Gemma3 (text and multimodal), Phi, GPT-2, GPT-J, GPT-NeoX,
# Falcon, BLOOM, OPT and MPT layouts.
LAYER_PATHS: tuple[str, ...] = (
    "model.layers",
    "model.language_model.layers",
    "model.model.layers",
    "language_model.model.layers",
    "transformer.h",
    "gpt_neox.layers",
    "model.decoder.layers",
    "transformer.blocks",
    "transformer.layers",
)

ATTENTION_NAMES: tuple[str, ...] = ("self_attn", "attn", "attention", "self_attention")


def _resolve(root: nn.Module, path: str) -> object | None:
    obj: object = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def find_decoder_layers(model: nn.Module, layers_path: str | None = None) -> nn.ModuleList:
    """The ordered list of transformer blocks whose outputs form the trajectory.

    ``layers_path`` (e.g. ``"model.layers"``) points at the list for a layout
    actmap does not know.
    """
    paths = (layers_path,) if layers_path else LAYER_PATHS
    for path in paths:
        layers = _resolve(model, path)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return layers
    if layers_path:
        raise UnknownModelLayout(
            f"{type(model).__name__} has no non-empty nn.ModuleList at '{layers_path}'"
        )
    raise UnknownModelLayout(
        f"cannot find the decoder layers of {type(model).__name__}; tried "
        f"{', '.join(LAYER_PATHS)}. Pass layers_path='<dotted.path.to.ModuleList>' "
        "(for example layers_path='model.layers')."
    )


def find_attention_modules(layers: nn.ModuleList) -> list[nn.Module]:
    """The self-attention module of every decoder layer, in layer order."""
    modules = []
    for index, layer in enumerate(layers):
        module = next(
            (
                getattr(layer, n)
                for n in ATTENTION_NAMES
                if isinstance(getattr(layer, n, None), nn.Module)
            ),
            None,
        )
        if module is None:
            raise UnknownModelLayout(
                f"decoder layer {index} ({type(layer).__name__}) has none of the attention "
                f"attributes {ATTENTION_NAMES}"
            )
        modules.append(module)
    return modules
