"""One error policy for every dflash command: known failures print one line and exit 2, never a traceback."""

from __future__ import annotations

import argparse
import errno
import sys
from collections.abc import Callable, Sequence

from .errors import ShardError


def run_main(
    main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None, prog: str
) -> int:
    """Call `main(argv)`; turn user-facing errors into `prog: error: message` on stderr and exit code 2."""
    try:
        return int(main(argv) or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except (ShardError, ValueError, FileNotFoundError, NotADirectoryError, PermissionError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the environment failed (disk, filesystem): name the file, no traceback
        if exc.errno == errno.ENOSPC:
            print(
                f"{prog}: error: no space left on device ({exc.filename or 'output'}); "
                "committed work is intact, free space and re-run the same command to resume",
                file=sys.stderr,
            )
        else:
            where = f"{exc.filename}: " if exc.filename else ""
            print(f"{prog}: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` with every default: argparse's own, shown where there is one worth showing (not None or
    False, and not already spelled out in the flag's text)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if any(action.default is no for no in (None, False, argparse.SUPPRESS)) or "default" in text:
            return text
        return super()._get_help_string(action)
