"""A user's model from a Python entry point `module:function`, made into programs on the client
(model_fn): the one place the client side builds a jax.export program.

May import: itself; the engine (modeling, programs) and jax inside functions only.
"""
