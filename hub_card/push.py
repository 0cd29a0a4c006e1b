"""`deriv push FOLDER --repo-id NAME`: check the folder, then upload it with `huggingface_hub`.

`--dry-run` checks and lists, and sends nothing. A real push takes the token from the usual places
(`HF_TOKEN`, or what `hf auth login` stored); without one, or without a network, it fails with a
message and claims nothing.

What is sent is what was checked, and nothing else: the list is the folder's regular files inside it
(`folder/inside.py`: a link out, a dangling link, a folder linked in, a FIFO, a socket or a device refuses the
push by name before anything is opened), and `upload_folder` gets that list as its `allow_patterns`, each name
escaped, so the library's own walk (which follows links) cannot add a file the check did not see.
"""

from __future__ import annotations

import glob

from ..errors import UsageError
from ..folder.load import (
    SAFETENSORS,
    check_safetensors,
    check_shard_index,
    missing_files,
    read_folder,
    unpublishable,
    upload_list,
)


class PushError(RuntimeError):
    pass


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def validate_repo_id(repo_id: str) -> None:
    """NAME or OWNER/NAME, in the Hub's characters; a clear error otherwise."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id as hub_validate

    try:
        hub_validate(repo_id)
    except HFValidationError as error:
        raise UsageError(f"{repo_id!r} is not a valid repo id (expected NAME or OWNER/NAME): {error}") from error


def plan(path: str, repo_id: str) -> tuple[list[tuple[str, int]], list[str]]:
    """(files to upload with sizes, problems); raises for a bad repo id or a folder that is no model."""
    validate_repo_id(repo_id)
    folder = read_folder(path)
    files = upload_list(folder)  # every entry a regular file inside the folder, before any is opened
    refused = unpublishable(folder, files)
    if refused:
        raise UsageError(
            f"{path} holds {len(refused)} file{'s' if len(refused) > 1 else ''} a model folder should not publish: "
            f"{'; '.join(refused)}; move them out of the folder (nothing was sent)"
        )
    if folder.has(SAFETENSORS[1]):  # the shards an index names are inside the folder and hold what it says
        check_shard_index(path)
    check_safetensors(path)
    return files, missing_files(folder)


def push(path: str, repo_id: str, private: bool = False, revision: str | None = None, say=print) -> str:
    """Upload the folder's checked files (`plan`) to `repo_id`, those and no other; returns the commit URL. Raises
    PushError on any failure."""
    files, problems = plan(path, repo_id)
    if problems:
        raise PushError("The folder is incomplete, nothing was uploaded:\n  " + "\n  ".join(problems))
    from huggingface_hub import HfApi, get_token

    token = get_token()
    if not token:
        raise PushError(
            "No Hugging Face token: set HF_TOKEN or run `hf auth login` (a token with write access). "
            "Nothing was uploaded."
        )
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        say(
            f"uploading {len(files)} files ({_size(sum(s for _, s in files))}) to {repo_id}"
            + (f"@{revision}" if revision else "")
        )
        commit = api.upload_folder(
            folder_path=path,
            repo_id=repo_id,
            revision=revision,
            allow_patterns=[glob.escape(name) for name, _ in files],  # exactly the checked files: `[`, `*`, `?`
            # in a name match themselves
            commit_message="Upload Deriv model folder",
        )
    except Exception as error:  # network, auth, permissions: huggingface_hub raises many kinds
        raise PushError(f"Upload to {repo_id} failed, so it may be missing or incomplete there: {error}") from error
    return str(getattr(commit, "commit_url", commit))


def describe(files: list[tuple[str, int]]) -> str:
    width = max((len(name) for name, _ in files), default=0)
    lines = [f"  {name:<{width}}  {_size(size):>9}" for name, size in files]
    lines.append(f"  {len(files)} files, {_size(sum(s for _, s in files))} in all")
    return "\n".join(lines)
