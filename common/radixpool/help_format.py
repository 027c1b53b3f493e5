"""The `--help` formatter every `radixpool` subcommand uses."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends `(default: X)` to an option's help, except where there is nothing to show (no
    default, an empty list) or the help already says what happens by default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, [], argparse.SUPPRESS) or "default" in text:
            return action.help
        return super()._get_help_string(action)
