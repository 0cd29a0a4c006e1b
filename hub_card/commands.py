"""`deriv card`, `deriv push` and `deriv check`: the command-line side of the Hub room."""

from __future__ import annotations

import argparse
import sys

from ..arguments import existing_folder


def add_card_arguments(card: argparse.ArgumentParser) -> None:
    """`deriv card FOLDER`."""
    card.add_argument("folder", type=existing_folder)
    card.add_argument("--repo-id", default=None, help="the repo the usage snippets load (default: the folder name)")
    card.add_argument("--license", default="apache-2.0", help="the license in the card's metadata")
    card.set_defaults(func=run_card)


def add_push_arguments(push: argparse.ArgumentParser) -> None:
    """`deriv push FOLDER --repo-id NAME`."""
    push.add_argument("folder", type=existing_folder)
    push.add_argument("--repo-id", required=True, help="NAME or OWNER/NAME")
    push.add_argument("--private", action="store_true")
    push.add_argument("--revision", default=None, help="a branch to upload to (made if missing)")
    push.add_argument("--dry-run", action="store_true", help="check the folder and list the upload; send nothing")
    push.set_defaults(func=run_push)


def add_check_arguments(check: argparse.ArgumentParser) -> None:
    """`deriv check FOLDER`."""
    check.description = (
        "Load the folder the way a Hub user would, in a fresh process that cannot import this package: this runs "
        "the folder's own Python files (trust_remote_code=True), which is what it checks. Check only folders you "
        "trust, such as the ones you trained."
    )
    check.add_argument("folder", type=existing_folder)
    check.set_defaults(func=run_check)


def _folder_error(error: Exception) -> SystemExit:
    return SystemExit(str(error))


def run_card(ns: argparse.Namespace) -> int:
    from ..folder.load import checked_files
    from .card import write_card

    try:
        checked_files(ns.folder)  # the card is for publishing it: what push would refuse, refused before writing
        path = write_card(ns.folder, ns.repo_id, ns.license)
    except (FileNotFoundError, ValueError) as error:
        raise _folder_error(error) from error
    print(f"wrote {path}")
    return 0


def run_push(ns: argparse.Namespace) -> int:
    from .push import PushError, describe, plan, push

    try:
        files, problems = plan(ns.folder, ns.repo_id)
        if ns.dry_run:
            print(f"dry run: would upload to {ns.repo_id}" + (f"@{ns.revision}" if ns.revision else ""))
            print(describe(files))
            if problems:
                print("incomplete, a real push would refuse:\n  " + "\n  ".join(problems), file=sys.stderr)
                return 1
            print("complete: nothing was uploaded (dry run)")
            return 0
        url = push(ns.folder, ns.repo_id, ns.private, ns.revision)
    except (FileNotFoundError, ValueError) as error:  # bad input: the CLI prints one `deriv: error:` line
        raise _folder_error(error) from error
    except PushError as error:  # the upload itself failed
        print(f"deriv: error: {error}", file=sys.stderr)
        return 1
    print(f"uploaded: {url}")
    return 0


def run_check(ns: argparse.Namespace) -> int:
    from .check import check_folder

    try:
        steps = check_folder(ns.folder)
    except (FileNotFoundError, ValueError) as error:
        raise _folder_error(error) from error
    for step in steps:
        print(f"{'PASS' if step['ok'] else 'FAIL'}  {step['step']:<9}  {step['detail']}")
    failed = [s["step"] for s in steps if not s["ok"]]
    print(f"{ns.folder}: " + (f"FAILED ({', '.join(failed)})" if failed else "every step passed"))
    return 1 if failed else 0
