"""A Hugging Face causal language model calibrated layer by layer (GPTQ) before its checkpoint is
quantized: the calibration itself, resumable, with its perplexity (calibration), each tensor's
plan as the run's plan makes it (plans), and its kept state on disk beside the output (work).

May import: base/, formats/, run/ and itself; the engine (engine/lm, engine/contrib) inside
functions only.
"""
