"""argparse pieces shared by every ``kvserve`` command line (argparse only: ``--help`` must
not import torch).

``HelpParser`` is an ``ArgumentParser`` whose help keeps descriptions as written and shows each
option's default after its help text; subparsers made from it are ``HelpParser`` too.
"""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already says what the
    default is, or there is none to show (``None``, a flag's ``False``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.help is argparse.SUPPRESS or not action.option_strings:
            return text
        if "default" in text.lower() or any(action.default is v for v in
                                            (None, False, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)"


class HelpParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
