"""A Hugging Face folder whose output head is tied to its input embedding, read as if untied: one
tensor more, the head (the embedding's bytes under the head's name, last), and config.json's
tie_word_embeddings false.

What a run writes when the output's head must differ from its embedding: a language model
rotated by --method hadamard (checkpoints/lm/methods.py), whose head takes the final norm's
scale and the embedding does not. The calibration's head is written in place of this copy (the
pipeline's `replaced`); the writers see an ordinary folder that has an lm_head.weight, and
transformers and vLLM load the output untied.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from qmill.checkpoints.formats.hf_folder import folder as folder_lib

# config.json's switch: transformers ties the head to the embedding unless it is false.
TIE = "tie_word_embeddings"


class UntiedHeadSource(folder_lib.HfFolderSource):
    """`source` with its head untied (the module docstring). It shares the source's weights:
    closing either closes both."""

    def __init__(self, source: folder_lib.HfFolderSource, head: str, embedding: str) -> None:
        # No HfFolderSource.__init__: the folder, its weights and config are the source's.
        self.folder = source.folder
        self.weights = source.weights
        self.separator = source.separator
        self.has_config = source.has_config
        self.config = {**source.config, TIE: False}
        entries = source.entries()
        by_path = {e.path: e for e in entries}
        if head in by_path:
            raise ValueError(f"{source.folder} has its own {head}: its head is not tied")
        if embedding not in by_path:
            raise ValueError(f"{source.folder} has no {embedding} to untie the head from")
        self._entries = [*entries, dataclasses.replace(by_path[embedding], path=head)]
        self._head, self._embedding = head, embedding

    def entries(self) -> list[Any]:
        return list(self._entries)

    def read(self, path: str) -> np.ndarray:
        return self.weights.read(self._embedding if path == self._head else path)


def untied(source: Any, untie: tuple[str, str] | None) -> Any:
    """`source` with its head untied, for `untie` = (head, embedding) names; `source` itself for
    None.

    Raises:
      ValueError: a source that is not a Hugging Face folder with a config.json, or whose
        head is its own already.
    """
    if untie is None:
        return source
    if not isinstance(source, folder_lib.HfFolderSource) or not source.has_config:
        raise ValueError("untying a head takes a Hugging Face model folder with its config.json")
    return UntiedHeadSource(source, *untie)
