"""The Hub room: the model card of an exported folder, the dry run and the upload, the clean-process check,
and `load_folder`, the one way every command and room opens an exported folder.

It reads exported folders only (config.json, run.json, the files beside them) and imports nothing from
the training room, so it works on any folder with the same layout.
"""

from .card import build_card, write_card
from .check import check_folder, run_as_hub_user
from .folder import LoadedFolder, load_folder, missing_files, read_folder, upload_list
from .push import PushError, push


__all__ = [
    "build_card",
    "write_card",
    "check_folder",
    "run_as_hub_user",
    "load_folder",
    "LoadedFolder",
    "read_folder",
    "missing_files",
    "upload_list",
    "push",
    "PushError",
]
