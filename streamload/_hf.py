"""Folders written by Hugging Face ``datasets``' ``save_to_disk``: recognised, with what to do.

``save_to_disk`` writes Arrow files (``data-00000-of-00001.arrow``) with ``state.json`` and
``dataset_info.json`` beside them (a ``DatasetDict``: ``dataset_dict.json`` and one such
folder per split). streamload reads Parquet: :func:`saved_to_disk` tells such a folder
apart, and says how to write it as Parquet first, so ``convert`` and ``index`` answer it
with that instead of "no input found".
"""

from __future__ import annotations

import os

from ._files import printable

__all__ = ["saved_to_disk"]


def saved_to_disk(folder: str) -> str | None:
    """What to do with ``folder`` if ``save_to_disk`` wrote it (a one-line message), else ``None``."""
    try:
        names = set(os.listdir(folder))
    except OSError:
        return None
    shown = printable(folder)
    if "dataset_dict.json" in names:
        splits = sorted(n for n in names if os.path.isfile(os.path.join(folder, n, "state.json")))
        split = "train" if "train" in splits or not splits else splits[0]
        return (
            f"{shown} is a Hugging Face DatasetDict written by save_to_disk (splits: {', '.join(splits) or '-'}; "
            "Arrow files, which streamload does not read): write each split as Parquet first, e.g. "
            f"python -c \"import datasets; datasets.load_from_disk('{shown}')['{split}']"
            f".to_parquet('{split}.parquet')\", "
            f"then convert or index {split}.parquet"
        )
    if "state.json" in names and any(n.endswith(".arrow") for n in names):
        return (
            f"{shown} is a Hugging Face dataset written by save_to_disk (Arrow files, which streamload does not "
            'read): write it as Parquet first, e.g. python -c "import datasets; '
            f"datasets.load_from_disk('{shown}').to_parquet('data.parquet')\", then convert or index data.parquet"
        )
    return None
