"""Reading bench/lm_moe_peer_bench.py's outputs: each folder's model through transformers
(float32 logits and perplexity), every expert's scales and the routers' dtype, the stored 4-bit
codes, and a check of a run's GPTQ against llm-compressor's own GPTQ function on one Hessian.

Needs the interop extra (torch, transformers, compressed-tensors, llmcompressor).
"""

from __future__ import annotations

import pathlib
import shutil

# transformers' Mixtral reads an expert's gate, up and down projections from these names;
# llm-compressor 0.14 writes them under its linearized modules' (gate_proj, up_proj, down_proj).
MIXTRAL_EXPERT_NAMES = {".gate_proj.": ".w1.", ".up_proj.": ".w3.", ".down_proj.": ".w2."}


def renamed_copy(folder: pathlib.Path) -> pathlib.Path:
    """A copy of the folder with a Mixtral's expert tensors under transformers' names (the
    tensors themselves unchanged), beside it as FOLDER-renamed."""
    from safetensors.torch import load_file, save_file

    copy = folder.with_name(folder.name + "-renamed")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(folder, copy)
    for path in copy.glob("*.safetensors"):
        tensors = {}
        for key, value in load_file(path).items():
            if ".block_sparse_moe.experts." in key:
                for theirs, ours in MIXTRAL_EXPERT_NAMES.items():
                    key = key.replace(theirs, ours)
            tensors[key] = value
        save_file(tensors, path, metadata={"format": "pt"})
    if (copy / "model.safetensors.index.json").exists():  # the bench's models are one file
        raise NotImplementedError(f"{folder}: sharded; its index would need the new names too")
    return copy


def load(folder: pathlib.Path):
    """The folder's model in float32 through transformers, and how it loaded. Where transformers
    leaves weights missing (a Mixtral written by llm-compressor: its experts under the
    linearized names, which neither transformers nor llm-compressor's load_quantizable_moe
    reads back), the folder is loaded from a copy with those tensors renamed (renamed_copy).
    Raises if weights are still missing: newly initialized weights would be measured."""
    import torch
    from transformers import AutoModelForCausalLM

    def attempt(path):
        return AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, output_loading_info=True
        )

    model, info = attempt(folder)
    how = {"loaded_with": "transformers"}
    if info["missing_keys"]:
        how = {
            "loaded_with": "transformers, expert tensors renamed gate/up/down_proj -> w1/w3/w2",
            "transformers_missing": sorted(info["missing_keys"])[:4],
            "transformers_missing_count": len(info["missing_keys"]),
        }
        model, info = attempt(renamed_copy(folder))
        if info["missing_keys"]:
            raise RuntimeError(f"{folder}: weights missing {sorted(info['missing_keys'])[:8]}")
    # transformers 5.17 leaves a compressed-tensors folder's kept bf16 tensors (the routers) in
    # bf16 whatever `dtype` says, then fails to multiply them with float32 states.
    for param in model.parameters():
        if param.dtype == torch.bfloat16:
            param.data = param.data.float()
    return model.eval(), how


def forward(folder: pathlib.Path, ids):
    """transformers' float32 logits of the folder's model on `ids` (samples × tokens), the
    perplexity of every next token, and how the model loaded."""
    import numpy as np
    import torch

    model, how = load(folder)
    tokens = torch.from_numpy(np.asarray(ids, dtype=np.int64))
    with torch.inference_mode():
        logits = model(input_ids=tokens).logits.float()
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    )
    return logits.numpy(), float(np.exp(float(nll))), how


def inspect(folder: pathlib.Path) -> dict:
    """Every expert's weight_scale (count, all finite and > 0) and the routers' dtypes."""
    import numpy as np
    import safetensors

    scales, good, routers = 0, 0, set()
    for path in sorted(folder.glob("*.safetensors")):
        with safetensors.safe_open(path, "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if ".experts." in key and key.endswith("weight_scale"):
                    scale = f.get_tensor(key).float().numpy()
                    scales += 1
                    good += int(bool(np.all(np.isfinite(scale)) and np.all(scale > 0)))
                elif key.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                    routers.add(str(f.get_tensor(key).dtype).removeprefix("torch."))
    return {
        "expert_scales": scales,
        "expert_scales_finite_positive": good == scales > 0,
        "router_dtypes": sorted(routers),
    }


def distance(a, b) -> float:
    import numpy as np

    return float(np.linalg.norm((a - b).ravel()))


def _tensors(folder: pathlib.Path) -> dict:
    """Every tensor of the folder's safetensors files (torch)."""
    from safetensors.torch import load_file

    found: dict = {}
    for path in sorted(folder.glob("*.safetensors")):
        found |= load_file(path)
    return found


def _source_name(key: str) -> str:
    """A written tensor's name as the source folder spells it (a peer's Mixtral expert renamed)."""
    if ".block_sparse_moe.experts." in key:
        key += "."  # the names' patterns end in a dot
        for theirs, ours in MIXTRAL_EXPERT_NAMES.items():
            key = key.replace(theirs, ours)
        key = key.removesuffix(".")
    return key


def codes(folder: pathlib.Path) -> dict:
    """The folder's 4-bit codes ({linear's source name: int8 codes, rows × columns}) and scales
    ({same name: float32 group scales}), from compressed-tensors' pack-quantized tensors."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    tensors, found, scales = _tensors(folder), {}, {}
    for key, packed in tensors.items():
        if key.endswith(".weight_packed"):
            base = key.removesuffix(".weight_packed")
            shape = tuple(tensors[f"{base}.weight_shape"].tolist())
            found[_source_name(base)] = unpack_from_int32(packed, 4, shape)
            scales[_source_name(base)] = tensors[f"{base}.weight_scale"].float()
    return {"codes": found, "scales": scales}


def same_codes(a: dict, b: dict, only: list[str] | None = None) -> float | None:
    """The share of equal codes over the linears both hold (of those named in `only`)."""
    names = [n for n in a["codes"] if n in b["codes"] and (only is None or n in only)]
    if not names:
        return None
    equal = sum(int((a["codes"][n] == b["codes"][n]).sum()) for n in names)
    return round(equal / sum(a["codes"][n].numel() for n in names), 5)


def same_scales(a: dict, b: dict) -> float | None:
    """The share of equal group scales (as float32) over the linears both hold."""
    names = [n for n in a["scales"] if n in b["scales"]]
    if not names:
        return None
    equal = sum(int((a["scales"][n] == b["scales"][n]).sum()) for n in names)
    return round(equal / sum(a["scales"][n].numel() for n in names), 5)


LAYER0_QKV = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]


def layer0_hessian(source: pathlib.Path, ids):
    """H = XᵀX of layer 0's attention input (the normalized embeddings: every tool's first
    linears see it unquantized) over the calibration ids, transformers float32."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    seen = []

    def keep(module, args, kwargs):
        states = kwargs["hidden_states"]
        seen.append(states.reshape(-1, states.shape[-1]).double())

    model.model.layers[0].self_attn.register_forward_pre_hook(keep, with_kwargs=True)
    with torch.inference_mode():
        model(input_ids=torch.from_numpy(np.asarray(ids, dtype=np.int64)))
    return (seen[0].T @ seen[0]).float()


def peer_function_agreement(source: pathlib.Path, run: dict, hessian, group: int) -> float:
    """The share of layer 0's q/k/v codes of `run` (codes()) that llm-compressor's GPTQ
    function (quantize_weight: its defaults, static activation order) gives on the same
    weights, the same Hessian and the run's own scales."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight

    weights = _tensors(source)
    args = QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=group,
                            actorder="static")  # fmt: skip
    equal = total = 0
    for name in LAYER0_QKV:
        weight, scale = weights[f"{name}.weight"].float(), run["scales"][name]
        fitted, _, _ = quantize_weight(weight[None].clone(), hessian[None].clone(), scale[None],
                                       torch.zeros_like(scale)[None], None, args)  # fmt: skip
        theirs = torch.round(fitted[0] / scale.repeat_interleave(group, dim=1))
        equal += int((theirs == run["codes"][name].float()).sum())
        total += theirs.numel()
    return round(equal / total, 5)
