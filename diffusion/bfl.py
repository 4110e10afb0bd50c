"""Black Forest Labs' names of the Flux transformer -> diffusers' FluxTransformer2DModel names.

BFL's reference code (and so `flux1-schnell.safetensors`, `flux1-dev.safetensors` and the LoRAs
trained on it) names the transformer's layers its own way and fuses some of them: a double
block's q, k and v are one `qkv` linear, a single block's q, k, v and MLP input are one
`linear1`. diffusers (loaders/single_file_utils.py, 0.42.1:
convert_flux_transformer_checkpoint_to_diffusers) splits them by output rows. This module is
the one place that says where every BFL row goes, for the single-file loader
(diffusion/single_file.py) and for LoRAs in BFL's names alike.

A mapping is a list of (diffusers module, first row, end row): rows [first, end) of the BFL
module's output go to the diffusers module. A diffusers module named more than once takes the
row ranges concatenated in the order listed: the final modulation
(`final_layer.adaLN_modulation.1` -> `norm_out.linear`) is BFL's (shift, scale) and diffusers'
(scale, shift) (its swap_scale_shift), so it is listed as the second half, then the first.
A module's bias splits as its weight's rows do.

Only the config's sizes are read (FluxConfig's fields and inner_dim), and nothing here imports
jax or flax: the oracle (tests/oracle/flux_files.py) writes BFL files with these names, which
diffusers' own conversion must map back exactly.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diffusion.nn.flux import FluxConfig

Rows = list[tuple[str, int, int]]  # (diffusers module, first row, end row) of the BFL module's output

_EMBEDDERS = {"time_in": "timestep_embedder", "vector_in": "text_embedder", "guidance_in": "guidance_embedder"}
# A double block's layers per stream: BFL's name (after img_/txt_) -> diffusers' (image, text).
_DOUBLE = {"mod.lin": ("norm1.linear", "norm1_context.linear"), "attn.proj": ("attn.to_out.0", "attn.to_add_out"),
           "mlp.0": ("ff.net.0.proj", "ff_context.net.0.proj"), "mlp.2": ("ff.net.2", "ff_context.net.2")}
_QKV = {"img": ("attn.to_q", "attn.to_k", "attn.to_v"),
        "txt": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
# The per-head RMSNorm scales (BFL `<attention>.norm.{query,key}_norm.scale`, diffusers `<norm>.weight`).
_NORMS = {"img_attn": ("attn.norm_q", "attn.norm_k"), "txt_attn": ("attn.norm_added_q", "attn.norm_added_k")}


def bfl_modules(config: FluxConfig) -> list[str]:
    """Every BFL module of the transformer that holds a weight matrix (a Linear), in BFL's order."""
    return list(_linears(config))


def diffusers_modules(bfl_module: str, config: FluxConfig) -> Rows:
    """Where the BFL module's output rows go (see the module docstring); KeyError for a name
    that is not one of bfl_modules(config)."""
    try:
        return list(_linears(config)[bfl_module])
    except KeyError:
        raise KeyError(f"{bfl_module!r} is not a linear layer of {_described(config)}") from None


def diffusers_tensors(bfl_tensor: str, config: FluxConfig) -> Rows:
    """Where a BFL tensor's rows go, by diffusers tensor name: a linear's `weight` and `bias`
    (split as diffusers_modules says) and the attention norms' `scale` (diffusers' `weight`);
    KeyError for any other name."""
    module, _, leaf = bfl_tensor.rpartition(".")
    if leaf in ("weight", "bias") and module in _linears(config):
        return [(f"{name}.{leaf}", first, end) for name, first, end in _linears(config)[module]]
    if bfl_tensor in _norms(config):
        return [(_norms(config)[bfl_tensor], 0, config.attention_head_dim)]
    raise KeyError(f"{bfl_tensor!r} is not a tensor (a linear's weight or bias, or an attention norm's scale) "
                   f"of {_described(config)}")


def bfl_tensors(config: FluxConfig) -> list[str]:
    """Every tensor of the transformer in BFL's names (what a whole BFL file holds)."""
    return [f"{module}.{leaf}" for module in _linears(config) for leaf in ("weight", "bias")] + list(_norms(config))


def _described(config: FluxConfig) -> str:
    guidance = "a guidance embedding" if config.guidance_embeds else "no guidance embedding"
    return (f"a Flux transformer in Black Forest Labs' names with {config.num_layers} double blocks, "
            f"{config.num_single_layers} single blocks and {guidance}")


def _linears(config: FluxConfig) -> dict[str, Rows]:
    out = config.patch_size ** 2 * (config.out_channels or config.in_channels)
    return _linear_table(config.inner_dim, config.num_layers, config.num_single_layers, config.guidance_embeds, out)


@functools.cache
def _linear_table(d: int, double: int, single: int, guidance: bool, out: int) -> dict[str, Rows]:
    whole = lambda name, rows: [(name, 0, rows)]  # noqa: E731
    table: dict[str, Rows] = {"img_in": whole("x_embedder", d), "txt_in": whole("context_embedder", d)}
    for bfl, ours in _EMBEDDERS.items():
        if bfl != "guidance_in" or guidance:
            table[f"{bfl}.in_layer"] = whole(f"time_text_embed.{ours}.linear_1", d)
            table[f"{bfl}.out_layer"] = whole(f"time_text_embed.{ours}.linear_2", d)
    for i in range(double):
        block, at = f"double_blocks.{i}", f"transformer_blocks.{i}"
        for stream, side in (("img", 0), ("txt", 1)):
            table[f"{block}.{stream}_mod.lin"] = whole(f"{at}.{_DOUBLE['mod.lin'][side]}", 6 * d)
            table[f"{block}.{stream}_attn.qkv"] = [(f"{at}.{name}", k * d, (k + 1) * d)
                                                   for k, name in enumerate(_QKV[stream])]
            table[f"{block}.{stream}_attn.proj"] = whole(f"{at}.{_DOUBLE['attn.proj'][side]}", d)
            table[f"{block}.{stream}_mlp.0"] = whole(f"{at}.{_DOUBLE['mlp.0'][side]}", 4 * d)
            table[f"{block}.{stream}_mlp.2"] = whole(f"{at}.{_DOUBLE['mlp.2'][side]}", d)
    for i in range(single):
        block, at = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        table[f"{block}.linear1"] = [(f"{at}.attn.to_q", 0, d), (f"{at}.attn.to_k", d, 2 * d),
                                     (f"{at}.attn.to_v", 2 * d, 3 * d), (f"{at}.proj_mlp", 3 * d, 7 * d)]
        table[f"{block}.linear2"] = whole(f"{at}.proj_out", d)
        table[f"{block}.modulation.lin"] = whole(f"{at}.norm.linear", 3 * d)
    table["final_layer.linear"] = whole("proj_out", out)
    table["final_layer.adaLN_modulation.1"] = [("norm_out.linear", d, 2 * d), ("norm_out.linear", 0, d)]
    return table


def _norms(config: FluxConfig) -> dict[str, str]:
    return _norm_table(config.num_layers, config.num_single_layers)


@functools.cache
def _norm_table(double: int, single: int) -> dict[str, str]:
    """BFL's RMSNorm scale tensors -> diffusers' tensor names."""
    table = {}
    for i in range(double):
        for attention, (q, k) in _NORMS.items():
            table[f"double_blocks.{i}.{attention}.norm.query_norm.scale"] = f"transformer_blocks.{i}.{q}.weight"
            table[f"double_blocks.{i}.{attention}.norm.key_norm.scale"] = f"transformer_blocks.{i}.{k}.weight"
    for i in range(single):
        table[f"single_blocks.{i}.norm.query_norm.scale"] = f"single_transformer_blocks.{i}.attn.norm_q.weight"
        table[f"single_blocks.{i}.norm.key_norm.scale"] = f"single_transformer_blocks.{i}.attn.norm_k.weight"
    return table
