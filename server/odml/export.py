"""LiteRT (.tflite) export: a Flax model + rules (+ quant_stats) -> flatbuffer bytes.

The route (see docs/odml-route.md): the model runs under OdmlConversionProvider, so every
quantize -> dequantize pair is a ``quant.fake_quant`` composite carrying qmill's scales; the
function is exported with ``jax.export``; the standalone ``litert-converter`` turns the StableHLO
into TFLite in strict QDQ mode (without it the composites would stay as composite ops and the
weights float). The converter and the LiteRT schema are imported lazily: they come with the
optional ``qmill[odml]`` extra, and a server without it still serves everything else.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from qmill.engine.modeling import rules as rules_lib
from qmill.engine.programs import program as programs
from qmill.engine.providers import model as model_lib
from qmill.engine.providers import odml, odml_conversion
from qmill.server.odml.availability import INSTALL_HINT as INSTALL_HINT
from qmill.server.odml.availability import availability as availability

# The converter's MLIR context setup is global C++ state; one conversion at a time.
_convert_lock = threading.Lock()


class OdmlUnavailable(RuntimeError):
    """The LiteRT converter is not installed here."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportInfo:
    """What the exported model holds."""

    # Operator names in execution order ("QUANTIZE", "CONV_2D", ...).
    ops: tuple[str, ...]
    # Quantized constant (weight) tensors by storage type ("INT8": 4).
    quantized_weights: Mapping[str, int]
    # The fake quants the converter received, with qmill's scales (and weight values).
    fake_quants: tuple[odml.FakeQuantRecord, ...]


def _require() -> tuple[Any, Any, Any, Any]:
    try:
        import litert_converter.converter_api_ext as capi
        from ai_edge_litert import schema_py_generated as schema
        from litert_converter.mlir import ir, passmanager
    except ImportError as exc:
        raise OdmlUnavailable(f"{INSTALL_HINT} ({exc})") from exc
    return capi, ir, passmanager, schema


def export_tflite(
    module: Any,
    params: Any,
    rules: Sequence[rules_lib.QuantizationRule],
    quant_stats: Any | None,
    input: jax.ShapeDtypeStruct,
) -> tuple[bytes, ExportInfo]:
    """Exports ``module`` quantized by ``rules`` to a .tflite flatbuffer.

    Args:
      module: an unbound Linen module (the float model).
      params: its float params (pure dict).
      rules: weight-only rules, or static-range rules (act_static_scale=True) with quant_stats.
      quant_stats: statistics from a calibration with the same rules (OdmlQatProvider's carry the
        model output's range too, which makes the graph integer end to end); None: weight-only.
      input: shape and dtype of one model input, batch included.

    Returns:
      The flatbuffer bytes and what they hold.

    Raises:
      OdmlUnavailable: the qmill[odml] extra is missing.
      odml.LiteRtUnsupported: a rule asks for something LiteRT cannot store.
      ValueError: missing statistics, params that don't fit the model, a bad input.
    """
    schema = _require()[3]
    provider = odml_conversion.OdmlConversionProvider(rules, params, quant_stats)
    model = model_lib.quantize_model(module, provider)
    if not hasattr(model, "apply"):
        raise TypeError(f"export_tflite takes a Linen module, got {type(module).__name__}")
    constants = jax.tree.map(np.asarray, params)

    def forward(x: jax.Array) -> Any:
        return model.apply({"params": constants}, x)

    exported = jax.export.export(jax.jit(forward), platforms=["cpu"])(input)
    tflite = convert(exported)
    ops, weights = describe(tflite, schema)
    info = ExportInfo(
        ops=ops, quantized_weights=weights, fake_quants=tuple(provider.records.values())
    )
    return tflite, info


def export_program(program: programs.Program) -> tuple[bytes, ExportInfo]:
    """Converts a client's export program (engine/programs.py: the model already traced under
    OdmlConversionProvider, weights and scales inside) to a .tflite flatbuffer."""
    if program.kind != programs.EXPORT:
        raise programs.ProgramError(
            f"ExportOdml takes an export program, not a {program.kind} one: build it with "
            "`qmill export-program --kind export` (qmill.engine.programs.program.export_program)"
        )
    schema = _require()[3]
    tflite = convert(program.exported)
    ops, weights = describe(tflite, schema)
    return tflite, ExportInfo(ops=ops, quantized_weights=weights, fake_quants=())


def convert(exported: jax.export.Exported) -> bytes:
    """The LiteRT converter in strict QDQ mode on an exported (cpu, single-platform) function."""
    capi, ir, passmanager, _ = _require()
    n_in, n_out = len(exported.in_avals), len(exported.out_avals)
    with _convert_lock:
        ctx = ir.Context()
        capi.prepare_mlir_context(ctx)
        with ctx, ir.Location.unknown():
            from litert_converter.mlir.dialects import stablehlo

            mlir_module = stablehlo.deserialize_portable_artifact(
                ctx, exported.mlir_module_serialized
            )
            inputs = ["input"] if n_in == 1 else [f"input_{i}" for i in range(n_in)]
            outputs = ["output"] if n_out == 1 else [f"output_{i}" for i in range(n_out)]
            capi.set_signature(mlir_module.operation, "serving_default", inputs, outputs)
            config = capi.ConvertToTFLConfig()
            config.model_origin_framework = "JAX"
            config.strict_qdq_mode = True
            capi.run_convert_to_tfl_passes(mlir_module, passmanager.PassManager(), config)
            return bytes(capi.export_flatbuffer_to_bytes(mlir_module.operation))


def describe(tflite: bytes, schema: Any = None) -> tuple[tuple[str, ...], dict[str, int]]:
    """(operator names in order, quantized constant tensors by type) of a flatbuffer."""
    if schema is None:
        schema = _require()[3]
    model = schema.Model.GetRootAsModel(tflite, 0)
    op_names = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
    type_names = {v: k for k, v in vars(schema.TensorType).items() if not k.startswith("_")}
    codes = []
    for i in range(model.OperatorCodesLength()):
        code = model.OperatorCodes(i)
        codes.append(max(code.BuiltinCode(), code.DeprecatedBuiltinCode()))
    graph = model.Subgraphs(0)
    ops = tuple(
        op_names.get(codes[graph.Operators(i).OpcodeIndex()], "CUSTOM")
        for i in range(graph.OperatorsLength())
    )
    weights: dict[str, int] = {}
    for i in range(graph.TensorsLength()):
        tensor = graph.Tensors(i)
        quant = tensor.Quantization()
        has_data = model.Buffers(tensor.Buffer()).DataLength() > 0
        if has_data and quant is not None and quant.ScaleLength() > 0:
            name = type_names.get(tensor.Type(), str(tensor.Type()))
            if name.startswith("INT") and name != "INT32":  # INT32 constants are biases
                weights[name] = weights.get(name, 0) + 1
    return ops, weights
