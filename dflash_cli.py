"""Command-line and YAML parsing for train_dflash.py with one-line errors: a flag of the wrong type
names the flag and what it expects, an unknown flag or YAML key gets a "did you mean", and a YAML
syntax error gives its file, line and column. The settings themselves are `train_dflash.TrainSettings`."""

import argparse
import difflib
import re

import yaml
from transformers import HfArgumentParser


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's '(default: X)' suffix, left out where the help text already says what the default
    is, and for None (an unset optional setting)."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or "").lower():
            return action.help
        return super()._get_help_string(action)


# argparse's type names -> what the flag expects, in words.
_EXPECTED = {"int": "an integer", "float": "a number", "str": "a string"}


class SettingsParser(HfArgumentParser):
    """HfArgumentParser that reports a bad flag value as one ValueError line (the flag, what it
    expects, what it got) instead of printing the whole usage text and exiting."""

    def error(self, message: str):
        invalid = re.fullmatch(r"argument (\S+?)(?:/\S+)?: invalid (\w+) value: (.*)", message)
        boolean = re.fullmatch(r"argument (\S+?)(?:/\S+)?: Truthy value expected: got (.*) but expected one of (.*) \(case insensitive\)\.", message)
        if invalid:
            flag, kind, value = invalid.groups()
            message = f"{flag} expects {_EXPECTED.get(kind, kind)}, got {value}"
        elif boolean:
            flag, value, accepted = boolean.groups()
            message = f"{flag} expects true or false ({accepted}), got {value!r}"
        else:
            message = re.sub(r"^argument (\S+?)(?:/\S+)?: ", r"\1: ", message)
        raise ValueError(f"{message}; see `python train_dflash.py --help`")


def did_you_mean(names: list[str], known: list[str], prefix: str = "") -> str:
    """'--num_anchor: did you mean --num_anchors?' for each name close to a known one ('' if none is)."""
    hints = []
    for name in names:
        bare = name.split("=", 1)[0].lstrip("-").replace("-", "_")
        close = difflib.get_close_matches(bare, known, n=2, cutoff=0.75)
        if close:
            hints.append(f"{name.split('=', 1)[0]}: did you mean {' or '.join(prefix + c for c in close)}?")
    return "; ".join(hints)


def yaml_error_line(path: str, error: yaml.YAMLError) -> str:
    """'configs/x.yaml, line 3, column 7: mapping values are not allowed here' (1-based, as
    editors count) for a YAML syntax error."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return f"{path}{where}: YAML syntax error: {problem}"
