"""qmill's model-as-program route: models that travel as serialized `jax.export` programs.

A client traces its model under a provider and serializes it (build); the server loads, checks
and runs the program on its device, never importing user code (program); zoo holds the built-in
model entries the server can calibrate and export by name. The top layer of the engine: it may
use everything below it.
"""
