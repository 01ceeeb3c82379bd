""".npz archives in (source, member by member) and out (writer, uncompressed as np.savez).

May import: base/ and itself.
"""
