"""Loading a task's JSONL that sits beside its YAML, whatever the working directory.

lm-eval 0.4.13 hands `dataset_kwargs.data_files` straight to
`datasets.load_dataset`, which resolves relative paths against the working
directory. ecomla's task YAMLs instead name a loader module beside them as
`custom_dataset: !function NAME_data.load` (lm-eval imports it from the
YAML's directory) with `dataset_kwargs: {data_file: NAME.jsonl}`; that module
calls `load_beside` with its own directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets


def load_beside(here: Path, data_file: str) -> datasets.DatasetDict:
    """The rows of here/data_file as the `test` split; data_file must be a plain file name in `here`."""
    path = here / data_file
    if Path(data_file).is_absolute() or path.parent != here:
        raise ValueError(f"data_file must be a file name in {here}, got {data_file!r}")
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
