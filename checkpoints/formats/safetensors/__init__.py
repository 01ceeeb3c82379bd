"""safetensors in and out: the file layout read and written directly (header), one file or a
sharded set read tensor by tensor (source), written with its index (writer).

May import: base/ and itself.
"""
