"""The exported folder, the contract between the rooms: its layout, its run record, how it is written, read,
loaded and checked. Every room that writes or opens a folder goes through here (DESIGN.md).

    atomic.py   a folder appears whole or not at all (`atomic_directory`), fsync, live-process checks
    target.py   may Deriv write this folder (never /, ~, a mount point, the working directory; a folder of the
                user's only with consent, none of its files replaced), and the `.deriv` marker
    record.py   run.json's schema (`RunRecord`), what training writes and the card reads
    load.py     reading a folder's files (`read_folder`), loading it for use (`load_folder`), the weight
                checks (safetensors only, every tensor present and of its shape), the upload list

    from deriv_lm.folder import load_folder
    loaded = load_folder("runs/deriv-tiny")          # model, tokenizer, generation config, run record
"""

from .atomic import atomic_directory
from .load import LoadedFolder, ModelFolder, load_folder, load_weights, missing_files, read_folder, upload_list
from .record import RunRecord


__all__ = [
    "LoadedFolder",
    "ModelFolder",
    "RunRecord",
    "atomic_directory",
    "load_folder",
    "load_weights",
    "missing_files",
    "read_folder",
    "upload_list",
]
