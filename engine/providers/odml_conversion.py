"""ODML's conversion mode: the model rebuilt with every quantization as a `quant.fake_quant`
composite carrying qmill's scales, which the LiteRT converter turns into quantized tensors (the
lingo, and what LiteRT can store: odml.py, beside OdmlQatProvider, whose ops this shares).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine.core import averaging, qarray, qtypes
from qmill.engine.modeling import flax_util
from qmill.engine.modeling import rules as rules_mod
from qmill.engine.providers import odml
from qmill.engine.providers import odml_boundary as boundary
from qmill.engine.providers import odml_names as names


class OdmlConversionProvider(odml._OdmlOps):
    """The model as LiteRT will run it: every fake quant is a ``quant.fake_quant`` composite.

    Scales are computed eagerly (in numpy terms) from ``params`` with qmill's own quantization,
    and, for static-range activations, from ``quant_stats``; the composites carry them to the
    converter. Export the model with its params closed over (constants), e.g.
    ``jax.export.export(jax.jit(lambda x: model.apply({"params": params}, x)))``.

    Supported: weight-only quantization and static-range quantization.
    """

    def __init__(
        self,
        rules: Sequence[rules_mod.QuantizationRule] | None = None,
        params: Any = None,
        quant_stats: Any = None,
        *,
        disable_per_channel_weights: bool = False,
    ) -> None:
        super().__init__(rules)
        # Float params (pure dict); weights are looked up here when the model sees tracers.
        self._params = flax_util.unbox(params) if params is not None else {}
        # Static-range statistics (pure dict, as QT / OdmlQatProvider collect them).
        self._stats = flax_util.unbox(quant_stats) if quant_stats is not None else {}
        self._per_tensor_weights = disable_per_channel_weights
        # Every fake quant of the last trace, by name (the export's info and tests read them).
        self.records: dict[str, odml.FakeQuantRecord] = {}

    # ---- ops --------------------------------------------------------------------------------

    def get_interceptors(self) -> list[Any]:
        """Two layers, as the reference's: structural (views), then numerical (ops)."""
        return boundary.layered_interceptors(self)

    def _run(self, rule, op_id, module, lhs, rhs, how, compute) -> jax.Array:
        path = "/".join(flax_util.module_path(module))
        operands = []
        for side, x in (("lhs", lhs), ("rhs", rhs)):
            for_lhs = side == "lhs"
            ref = flax_util.find_param(x, module)
            if ref is not None:
                x = self._weight(module, ref, x, how.weight(for_lhs), _join(path, ref.name))
            elif rule.act_qtype is not None:
                name = _join(path, f"{op_id}_{side}")
                odml._check_static(rule, name)
                x = self.shared_act(
                    module,
                    x,
                    rule,
                    how.act(for_lhs),
                    op_id,
                    side,
                    lambda x=x, name=name, side=side: self._activation(
                        x, rule, self._stat(module, f"{op_id}_{side}", op_id=op_id, side=side), name
                    ),
                )
            operands.append(x)
        return compute(*operands)

    def model_output(self, module: Any, out: Any, method_name: str = "__call__") -> Any:
        """Hook of quantize_model: the output's composite, when quant_stats has its statistic."""
        self._shared.reset()

        def composite(rule: rules_mod.QuantizationRule, name: str, y: Any) -> Any:
            stat = self._stat(module, name, required=False)
            if stat is None or not jnp.issubdtype(y.dtype, jnp.floating):
                return y
            return self._activation(y, rule, stat, name, kind="output")

        return boundary.map_outputs(self.rules, module, out, composite, method_name)

    def process_model_inputs(self, model: Any, model_args: Any, model_kwargs: Any) -> Any:
        """The model inputs' composites, where quant_stats has their statistic (see QAT)."""
        self._shared.reset()

        def composite(rule: rules_mod.QuantizationRule, name: str, y: Any) -> Any:
            stat = self._stat(model, name, required=False)
            return y if stat is None else self._activation(y, rule, stat, name, kind="input")

        args, kwargs = boundary.map_inputs(self.rules, model, (model_args, model_kwargs), composite)
        return model, args, kwargs

    # ---- weights and activations ----------------------------------------------------------

    def _weight(self, module, ref, x, how, name) -> jax.Array:
        bad = [v for v in ref.views if v not in odml._WEIGHT_VIEWS]
        if bad:
            raise odml.LiteRtUnsupported(
                f"{name} reaches its op through {bad}; store the weight in the layout its op "
                "uses, or exclude the module from the rules."
            )
        how = odml._per_tensor(how) if self._per_tensor_weights else how
        axis = odml.weight_axis(how, x.shape, name)
        odml.litert_dtype(how.qtype)
        value = self._concrete_weight(module, ref, x, name)
        with jax.ensure_compile_time_eval():
            qa = qarray.quantize(jnp.asarray(value, np.float32), how)
            if qa.zero_point is not None:
                raise odml.LiteRtUnsupported(
                    f"{name}: LiteRT weights are symmetric; use an absmax weight calibration."
                )
            # The composite's input is qmill's dequantized weight: the converter's
            # round(w / scale) then gives back qmill's integer values exactly.
            dequantized = np.asarray(qarray.dequantize(qa), np.float32)
            scale = np.asarray(qa.scale, np.float32).reshape(-1)
            qvalue = np.asarray(qa.qvalue).astype(np.int8)
        self.records[name] = odml.FakeQuantRecord(
            name=name,
            kind="weight",
            qtype=how.qtype,
            scale=scale,
            zero_point=None,
            quantization_dimension=axis,
            qvalue=qvalue,
        )
        return odml.fake_quant_composite(
            jnp.asarray(dequantized, x.dtype),
            qtype=how.qtype,
            scale=scale,
            quantization_dimension=axis,
        )

    def _concrete_weight(self, module, ref, x, name) -> np.ndarray:
        stored = _lookup(self._params, (*flax_util.module_path(module), ref.name))
        if stored is not None:
            return np.asarray(stored).reshape(x.shape)
        if isinstance(x, jax.core.Tracer):
            raise ValueError(
                f"{name} is traced and not in the params given to OdmlConversionProvider; pass "
                "the model's float params to the provider."
            )
        return np.asarray(x)

    def _stat(
        self, module, name, *, required=True, op_id=None, side=None
    ) -> Mapping[str, Any] | None:
        path = (*flax_util.module_path(module), name)
        stat = _lookup(self._stats, path)
        for legacy in names.legacy_names(name, op_id, side) if stat is None else ():
            # A calibration made before qmill followed the reference's names.
            stat = _lookup(self._stats, (*path[:-1], legacy))
            if stat is not None:
                break
        if stat is None and required:
            raise ValueError(
                f"no quant_stats for {'/'.join(path)}: static-range export needs statistics "
                "from a calibration with the same rules."
            )
        if stat is not None and int(stat["count"]) == 0:
            raise ValueError(f"quant_stats for {'/'.join(path)} hold no batches (count 0).")
        return stat

    def _activation(self, x, rule, stat, name, kind="activation") -> jax.Array:
        odml.litert_dtype(rule.act_qtype)
        with jax.ensure_compile_time_eval():
            axes = tuple(rule.act_batch_axes)
            calibration = {
                k: jnp.mean(jnp.asarray(v), axis=axes, keepdims=True)
                for k, v in averaging.calibration(stat).items()
            }
            scale, zero_point = qarray.compute_scale_zero_point(calibration, rule.act_qtype)
            scale = np.asarray(scale, np.float32).reshape(-1)
            zp = None if zero_point is None else np.asarray(zero_point).reshape(-1)
        if scale.size != 1:
            raise odml.LiteRtUnsupported(
                f"{name}: the statistics give {scale.size} activation scales; LiteRT stores one "
                "per activation tensor. Set act_batch_axes to every axis but the channel one "
                "(calibrate with --rules w8a8-static-seq for (batch, sequence, features) inputs)."
            )
        zp_int = None if zp is None else int(zp[0])
        self.records[name] = odml.FakeQuantRecord(
            name=name,
            kind=kind,
            qtype=qtypes.name(rule.act_qtype),
            scale=scale,
            zero_point=zp_int,
            quantization_dimension=-1,
        )
        return odml.fake_quant_composite(x, qtype=rule.act_qtype, scale=scale, zero_point=zp_int)


def _join(path: str, name: str) -> str:
    return f"{path}/{name}" if path else name


def _lookup(tree: Any, path: Sequence[str]) -> Any:
    for key in path:
        if not isinstance(tree, Mapping) or key not in tree:
            return None
        tree = tree[key]
    return tree
