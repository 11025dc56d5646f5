"""`--help` with each flag's default, except where the default says nothing: a switch (`--no-x` would read
"default: True") or a help text that already states its default in words."""
from __future__ import annotations

import argparse


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)
