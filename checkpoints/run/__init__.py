"""The run of `qmill quantize` over a checkpoint, whoever quantizes: the plan made before any work
(plan), the resumable pipeline that reads, sends and writes tensor by tensor (pipeline), what a
backend hands back per tensor (outcome), the in-process engine backend (embedded) and its
compilation cache (compilation_cache), and which tensors a calibration covers
(calibration_coverage).

May import: base/, formats/ (every room) and itself; the engine and jax inside functions only.
Never the client or the CLI: what they add (a server backend, a progress bar) is handed in.
"""
