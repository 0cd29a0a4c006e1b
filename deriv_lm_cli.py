"""The `deriv` console script: `deriv --help` in a blink, every command as `deriv_lm.cli.main` runs it.

The top-level parser needs neither torch nor transformers: `deriv_lm/cli.py` imports only the standard library
when it is loaded, so this launcher reads that file on its own, without the package, and lets its parser answer
`--help` and a missing or unknown command. (The package's `__init__` is lazy too, and each command's arguments,
paths included, are checked before its room imports torch; reading cli.py alone keeps `--help` independent of
every room.) A command to run is handed, whole, to `deriv_lm.cli.main`.
"""

import importlib.util
import os
import signal
import sys


def _cli_without_the_package():
    """deriv_lm/cli.py loaded as a module of its own, the package not imported; None where it cannot be."""
    package = importlib.util.find_spec("deriv_lm")  # finds the package without running its __init__
    for folder in (package and package.submodule_search_locations) or []:
        path = os.path.join(folder, "cli.py")
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_deriv_cli_table", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    table = _cli_without_the_package()
    if table is not None:
        table.build_parser().parse_args(argv)  # exits here for --help, no command or an unknown one
    try:
        from deriv_lm.cli import main as run
    except (KeyboardInterrupt, ImportError) as error:  # Ctrl-C before any command ran: the same line as a command's
        # subtle: a Ctrl-C that lands inside an import can surface as the ImportError it interrupted
        if not isinstance(error, KeyboardInterrupt) and not isinstance(error.__context__, KeyboardInterrupt):
            raise
        print("deriv: interrupted (SIGINT)", file=sys.stderr)
        return 130
    code = run(argv)
    # The command is done and has said so. Python's exit still joins threads and frees modules (seconds, with
    # torch loaded): a Ctrl-C or SIGTERM then would end the process with no line and status -2 or -15, or a
    # traceback from an exit handler. The work is complete, so the exit goes on with the command's status.
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    sys.exit(main())
