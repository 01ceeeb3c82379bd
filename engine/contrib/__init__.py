"""Algorithms beyond plain round-to-nearest PTQ (the reference's qwix.contrib)."""

from qmill.engine.contrib import calibration as calibration
from qmill.engine.contrib import gptq as gptq

__all__ = ["calibration", "gptq"]
