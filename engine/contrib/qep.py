"""QEP in Linen models: GPTQ stage by stage, each stage's weights corrected for the error the
already-quantized stages put into their inputs (qep_core has the maths).

`quantize` runs the whole method: one float pass finds the matched ops in forward order; ops that
read the same input array form one stage (e.g. the q, k, v projections); then, stage by stage,
every calibration batch runs twice, through the float model and through the model with the
earlier stages' weights quantized (dequantized back to float), the stage's ops' inputs from both
give its `<weight>_qep` statistics, and its weights are corrected and GPTQ-quantized. Weights no
stage holds are quantized as PTQ does. `quantize_params` applies the last step alone to
statistics gathered elsewhere.

The result feeds the ordinary PTQ model (codes and scales), as GPTQ's does.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import flax
import jax
from flax import linen as nn

from qmill.engine.contrib import calibration, gptq, gptq_core, qep_core
from qmill.engine.core import averaging, qarray
from qmill.engine.modeling import rules as rules_lib
from qmill.engine.providers import model as model_lib
from qmill.engine.providers import ptq

_STATS_SUFFIX = "_qep"


@dataclasses.dataclass(frozen=True, kw_only=True)
class QepRule(gptq.GptqRule):
    """A GptqRule whose matched weights QEP quantizes."""

    # How far the weight moves towards compensating its inputs' error: 0 is plain GPTQ, 1 the
    # full least-squares step (the paper recommends 0.5).
    correction_factor: float = 0.5
    # Fraction of mean(diag H) added to H's diagonal before inverting it for the correction.
    damping_factor: float = 0.01
    # False: GPTQ on the quantized inputs' Hessian without the correction (e.g. a first layer,
    # whose inputs carry no error).
    apply_correction: bool = True


@dataclasses.dataclass(frozen=True)
class QepStage:
    """One stage of a QEP run: the weights quantized together because their ops read the same
    input. index: its place in the run (0-based); param_paths: the weights' paths in params;
    module_paths: their modules, "/"-joined."""

    index: int
    param_paths: tuple[tuple[str, ...], ...]
    module_paths: tuple[str, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class QepResult:
    """What `quantize` returns: the PTQ model, its quantized params, the `_qep` statistics
    gathered (by weight, as quant_stats) and the stages in the order they ran."""

    model: nn.Module
    params: Any
    quant_stats: Any
    stages: tuple[QepStage, ...]


@dataclasses.dataclass(frozen=True)
class _Op:
    """A matched op found by the discovery pass."""

    key: tuple[Any, ...]  # (op name, module path, op id): the same op in every pass
    path: tuple[str, ...]  # its weight's path in params
    lhs_id: int  # id() of its input array: ops reading one array share a stage
    rule: QepRule


class _CaptureProvider(calibration.CalibrationProvider):
    """Records the matched ops (discovery) or the inputs of chosen ops (capture); writes no
    variables."""

    def __init__(self, rules: Sequence[rules_lib.QuantizationRule]) -> None:
        super().__init__(rules)
        self.ops: list[_Op] = []
        self._keys: frozenset[tuple[Any, ...]] | None = None
        self._captured: dict[tuple[Any, ...], jax.Array] = {}

    def get_rule_type(self) -> type[rules_lib.QuantizationRule]:
        return QepRule

    def get_stats_suffix(self) -> str:
        return _STATS_SUFFIX

    def discover(self) -> None:
        """The next pass records the matched ops in the order they run."""
        self.ops, self._keys, self._captured = [], None, {}

    def capture(self, keys: Collection[tuple[Any, ...]]) -> dict[tuple[Any, ...], jax.Array]:
        """The next pass fills the returned dict with the inputs of the ops `keys` name."""
        self._keys, self._captured = frozenset(keys), {}
        return self._captured

    def _collect_stats(
        self, lhs, weight_name, *, module_path, op_name, op_id, lhs_id, rule=None, **_
    ) -> None:
        key = (op_name, module_path, op_id)
        if self._keys is None:
            self.ops.append(_Op(key, (*module_path, weight_name), lhs_id, rule))
        elif key in self._keys:
            self._captured[key] = lhs


def _stages(ops: Sequence[_Op]) -> tuple[tuple[_Op, ...], ...]:
    """Consecutive ops reading the same input array, as stages.

    Raises:
      ValueError: no op matched, or one weight in two stages (its statistics would differ).
    """
    if not ops:
        raise ValueError(
            "No supported QEP ops were discovered: the QepRules must match dot_general or einsum "
            "ops whose right operand is a weight."
        )
    stages = tuple(tuple(group) for _, group in itertools.groupby(ops, key=lambda op: op.lhs_id))
    seen: set[tuple[str, ...]] = set()
    for stage in stages:
        paths = {op.path for op in stage}
        if paths & seen:
            raise ValueError(
                f"QEP cannot quantize a weight in two stages: {sorted(paths & seen)} is used by "
                "ops reading different inputs."
            )
        seen |= paths
    return stages


def _public(index: int, stage: Sequence[_Op]) -> QepStage:
    paths = tuple(dict.fromkeys(op.path for op in stage))
    modules = tuple(dict.fromkeys("/".join(op.path[:-1]) for op in stage))
    return QepStage(index=index, param_paths=paths, module_paths=modules)


def _quantize_weight(
    ctx: calibration.CalibratedQuantContext,
    rule: QepRule,
    gptq_block_size: int,
    gptq_damping_factor: float,
) -> ptq.WithAux:
    """One weight: corrected (unless the rule says not to), then GPTQ-quantized on H."""
    hessian = ctx.calibration_stats["hessian"]
    weight = ctx.weight
    if rule.apply_correction:
        delta = ctx.calibration_stats.get("hessian_delta")
        if delta is None:
            raise ValueError(
                f"hessian_delta not found in the QEP statistics of {ctx.path}: gather them with "
                "qep.quantize, or pass apply_correction=False."
            )
        weight = qep_core.weight_correct(
            weight,
            hessian,
            delta,
            correction_factor=rule.correction_factor,
            damping_factor=rule.damping_factor,
        )
    q, _ = gptq_core.quantize_weight(
        weight, hessian, ctx.how, blocksize=gptq_block_size, percdamp=gptq_damping_factor
    )
    return ctx.abs_w.replace(array=ctx.restore_shape(q))


def _batches(calibration_data: Any) -> Callable[[], Iterable[Any]]:
    """A factory of fresh iterators over the calibration data (each stage reads all of it)."""
    if callable(calibration_data):
        return calibration_data
    if iter(calibration_data) is calibration_data:
        raise ValueError(
            "calibration_data must be reiterable (a list, a dataset), or a zero-argument "
            "callable returning a fresh iterable: QEP reads it once per stage."
        )
    return lambda: iter(calibration_data)


def _flat(tree: Any) -> dict[tuple[Any, ...], Any]:
    if isinstance(tree, flax.core.FrozenDict):
        tree = flax.core.unfreeze(tree)
    return flax.traverse_util.flatten_dict(tree)


def _unflat(flat: Mapping[tuple[Any, ...], Any]) -> Any:
    return flax.traverse_util.unflatten_dict(dict(flat))


def _stage_stats(stage, run, float_provider, quant_provider) -> dict[tuple[Any, ...], Any]:
    """Every batch through both models; the stage's `<weight>_qep` statistics, averaged."""
    keys = [op.key for op in stage]
    stats: dict[tuple[Any, ...], Any] = {}
    for args, kwargs in run.batches():
        float_inputs = float_provider.capture(keys)
        run.float_pass(args, kwargs)
        quant_inputs = quant_provider.capture(keys)
        run.quant_pass(args, kwargs)
        for op in stage:
            x, x_q = float_inputs.get(op.key), quant_inputs.get(op.key)
            if x is None or x_q is None:
                raise ValueError(f"QEP saw no input of {'/'.join(op.path[:-1])} in a batch.")
            batch = qep_core.compute_qep_stats(x_q, x)
            name = (*op.path[:-1], op.path[-1] + _STATS_SUFFIX)
            stats[name] = averaging.update(stats.get(name) or averaging.init(batch), batch)
    return stats


@dataclasses.dataclass
class _Run:
    """The two calibration models of one QEP run and the params each sees."""

    float_model: nn.Module
    quant_model: nn.Module
    variables: Any
    float_params: Any
    dequantized: dict[tuple[Any, ...], Any]  # flat; a stage's weights replaced once quantized
    data: Callable[[], Iterable[Any]]
    adapter: Callable[[Any], tuple[Sequence[Any], Mapping[str, Any]]]

    def batches(self) -> Iterable[tuple[Sequence[Any], Mapping[str, Any]]]:
        return (self.adapter(batch) for batch in self.data())

    def float_pass(self, args, kwargs) -> None:
        self.float_model.apply({**self.variables, "params": self.float_params}, *args, **kwargs)

    def quant_pass(self, args, kwargs) -> None:
        params = _unflat(self.dequantized)
        self.quant_model.apply({**self.variables, "params": params}, *args, **kwargs)


def _run_stages(stages, run, providers, flat_trees, gptq_options):
    """Each stage in turn: its statistics, then its weights corrected and GPTQ-quantized, their
    dequantized values seen by the later stages' quantized passes.

    Returns:
      (the quantized weights by path, every stage's statistics by statistic path).
    """
    flat_float, flat_abstract = flat_trees
    quantized: dict[tuple[Any, ...], Any] = {}
    all_stats: dict[tuple[Any, ...], Any] = {}
    for stage in stages:
        stats = _stage_stats(stage, run, *providers)
        for op in {op.path: op for op in stage}.values():
            name = (*op.path[:-1], op.path[-1] + _STATS_SUFFIX)
            ctx = calibration.extract_calibrated_quant_context(
                op.path, flat_float[op.path], flat_abstract[op.path], stats[name]
            )
            if ctx is None:
                raise ValueError(f"{'/'.join(op.path)}: QEP needs one contracted axis.")
            result = _quantize_weight(ctx, op.rule, *gptq_options)
            quantized[op.path] = result
            run.dequantized[op.path] = qarray.dequantize(result.array)
        all_stats |= stats
    return quantized, all_stats


def quantize(
    model: nn.Module,
    calibration_data: Iterable[Any] | Callable[[], Iterable[Any]],
    rules: Sequence[QepRule],
    *,
    variables: Any = None,
    batch_adapter: Callable[[Any], tuple[Sequence[Any], Mapping[str, Any]]] | None = None,
    methods: Collection[str] = ("__call__",),
    abstract_quantized: Any = None,
    allow_extra_params: bool = False,
    gptq_block_size: int = 128,
    gptq_damping_factor: float = 0.01,
) -> QepResult:
    """QEP-quantizes a Linen model's weights stage by stage (see the module's docstring).

    Args:
      model: the float Linen module.
      calibration_data: batches, reiterable (a list), or a zero-argument callable returning a
        fresh iterable of them.
      rules: the QepRules (other rules' weights are quantized as PTQ does).
      variables: the float model's variables (params and any other collection).
      batch_adapter: a batch → (args, kwargs) of the model's call; default: the batch is the one
        argument.
      methods: the model's methods to quantize.
      abstract_quantized: the PTQ model's (abstract) params, if already made.
      allow_extra_params: passed to ptq.quantize_params for the weights outside every stage.
      gptq_block_size, gptq_damping_factor: GPTQ's blocksize and percdamp.

    Returns:
      A QepResult: the PTQ model with its params, the statistics and the stages.

    Raises:
      ValueError: not a Linen model, no variables, data that can't be read twice or is empty,
        rules matching no op.
    """
    adapter = batch_adapter or (lambda batch: ((batch,), {}))
    data, (args, kwargs) = _checked_inputs(model, variables, calibration_data, adapter)

    float_params = flax.core.unfreeze(variables["params"])
    float_provider, quant_provider = _CaptureProvider(rules), _CaptureProvider(rules)
    run = _Run(
        model_lib.quantize_model(model, float_provider, methods=methods),
        model_lib.quantize_model(model, quant_provider, methods=methods),
        variables,
        float_params,
        _flat(float_params),
        data,
        adapter,
    )
    float_provider.discover()
    run.float_pass(args, kwargs)
    stages = _stages(float_provider.ops)

    ptq_model = model_lib.quantize_model(model, ptq.PtqProvider(rules), methods=methods)
    if abstract_quantized is None:
        init = jax.eval_shape(ptq_model.init, jax.random.key(0), *args, **kwargs)
        abstract_quantized = init["params"]
    flat_float, flat_abstract = _flat(float_params), _flat(abstract_quantized)

    quantized, all_stats = _run_stages(
        stages,
        run,
        (float_provider, quant_provider),
        (flat_float, flat_abstract),
        (gptq_block_size, gptq_damping_factor),
    )
    rest = {path: w for path, w in flat_float.items() if path not in quantized}
    if rest:
        others = ptq.quantize_params(
            _unflat(rest), abstract_quantized, allow_extra_params=allow_extra_params
        )
        quantized |= flax.traverse_util.flatten_dict(
            others, is_leaf=lambda _, v: isinstance(v, ptq.WithAux)
        )
    return QepResult(
        model=ptq_model,
        params=_unflat(quantized),
        quant_stats=_unflat(all_stats),
        stages=tuple(_public(i, stage) for i, stage in enumerate(stages)),
    )


_NO_BATCH = object()


def _checked_inputs(model, variables, calibration_data, adapter):
    """(the batches as a re-iterable source, the first batch's (args, kwargs)), or the error
    that says what quantize() was given wrong."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"qep.quantize supports Linen models only, got {type(model).__name__}.")
    if variables is None:
        raise ValueError("qep.quantize needs the float model's variables (variables=...).")
    data = _batches(calibration_data)
    first = next(iter(data()), _NO_BATCH)
    if first is _NO_BATCH:
        raise ValueError("calibration_data must contain at least one batch.")
    return data, adapter(first)


def quantize_params(
    params: Any,
    abstract_quantized_params: Any,
    qep_quant_stats: Any,
    *,
    allow_extra_params: bool = False,
    gptq_block_size: int = 128,
    gptq_damping_factor: float = 0.01,
    correction_factor: float = 0.5,
    damping_factor: float = 0.01,
    apply_correction: bool = True,
) -> Any:
    """ptq.quantize_params, with QEP (correction then GPTQ) for the weights that have
    `<weight>_qep` statistics (`hessian`, and `hessian_delta` unless apply_correction is False).

    Returns:
      The quantized params for the PTQ model.
    """
    rule = QepRule(
        correction_factor=correction_factor,
        damping_factor=damping_factor,
        apply_correction=apply_correction,
    )
    return calibration.quantize_params_with_calibration(
        params,
        abstract_quantized_params,
        qep_quant_stats,
        _STATS_SUFFIX,
        lambda ctx: _quantize_weight(ctx, rule, gptq_block_size, gptq_damping_factor),
        allow_extra_params=allow_extra_params,
    )
