"""How a Flax model is watched while a provider quantizes it, below the providers and the ops.

Function interception (interception), the rules that say which op is quantized how (rules, with
their RE2 path patterns in linear_regex), the Flax plumbing for the running module, its path and
its variables for Linen and NNX alike (flax_util, which also defines the QuantStat variable), and
the identity of weights followed through reshapes (provenance). Imports only engine.core.
"""
