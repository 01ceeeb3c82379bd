"""qmill's own: Hugging Face causal LMs' forward pass in JAX, read from config.json (config,
rope, forward), cut into stages at each group of linears so that their layer-by-layer
calibration can quantize a layer's linears in order. Builds on no flax."""

from qmill.engine.lm import config as config
from qmill.engine.lm import forward as forward
from qmill.engine.lm import rope as rope
from qmill.engine.lm.config import SUPPORTED as SUPPORTED
from qmill.engine.lm.config import LmConfig as LmConfig
from qmill.engine.lm.config import from_hf_config as from_hf_config
from qmill.engine.lm.config import layer_prefix as layer_prefix
from qmill.engine.lm.config import layer_tensor_names as layer_tensor_names
from qmill.engine.lm.config import linear_names as linear_names
from qmill.engine.lm.config import outer_tensor_names as outer_tensor_names
from qmill.engine.lm.forward import Stage as Stage
from qmill.engine.lm.forward import embed as embed
from qmill.engine.lm.forward import layer_forward as layer_forward
from qmill.engine.lm.forward import logits as logits
from qmill.engine.lm.forward import run_stage as run_stage
from qmill.engine.lm.forward import stage_fn as stage_fn
from qmill.engine.lm.forward import stages as stages
from qmill.engine.lm.forward import token_nll as token_nll

__all__ = [
    "SUPPORTED",
    "LmConfig",
    "Stage",
    "config",
    "embed",
    "forward",
    "from_hf_config",
    "layer_forward",
    "layer_prefix",
    "layer_tensor_names",
    "linear_names",
    "logits",
    "outer_tensor_names",
    "rope",
    "run_stage",
    "stage_fn",
    "stages",
    "token_nll",
]
