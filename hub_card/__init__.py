"""The Hub room: the model card of an exported folder, the dry run and the upload, the clean-process check.
The folder itself (layout, run record, reading, loading, checks) is the folder room's, `deriv_lm.folder`.

It reads exported folders only (config.json, run.json, the files beside them) and imports nothing from
the training room, so it works on any folder with the same layout.
"""

from .card import build_card, write_card
from .check import check_folder, run_as_hub_user
from .push import PushError, push


__all__ = [
    "build_card",
    "write_card",
    "check_folder",
    "run_as_hub_user",
    "push",
    "PushError",
]
