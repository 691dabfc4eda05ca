"""Command-line and YAML parsing for train_dflash.py with one-line errors: a flag of the wrong type
names the flag and what it expects, a YAML value of the wrong type its file and key, an unknown flag
or YAML key gets a "did you mean", and a YAML syntax error gives its file, line and column. --help
lists the flags in groups, each with its default. The settings themselves are `train_dflash.TrainSettings`."""

import argparse
import copy
import difflib
import os
import re
import types
import typing

import yaml
from transformers import HfArgumentParser


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's '(default: X)' suffix, left out where the help text already says what the default
    is, and for None (an unset optional setting, whose help text says what unset means). Each flag
    is shown in one form, --x_y: HfArgumentParser also accepts --x-y, and listing both doubled every
    line of --help."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or "").lower():
            return action.help
        return super()._get_help_string(action)

    def _format_action_invocation(self, action):
        action = copy.copy(action)  # the parser's own action keeps every form: --x-y is still accepted
        action.option_strings = [
            option for option in action.option_strings if not ("-" in option[2:] and "--" + option[2:].replace("-", "_") in action.option_strings)
        ]
        return super()._format_action_invocation(action)


# argparse's type names -> what the flag expects, in words.
_EXPECTED = {"int": "an integer", "float": "a number", "str": "a string"}


# The groups of train_dflash.py --help, in the order shown: key (what a setting's metadata["group"]
# names) -> (title, description).
SETTING_GROUPS = {
    "data": ("target and data", "the frozen target model and the conversations the drafter learns from"),
    "drafter": ("drafter", "the drafter's shape, sized after the target's unless set (docs/drafters.md)"),
    "objective": ("objective", "what each block position is trained on and how positions are weighted"),
    "optimisation": ("optimisation", "AdamW under DeepSpeed ZeRO-2, the schedule and the length of the run"),
    "speed": ("speed and memory", "the same training, faster or in less memory (docs/training.md)"),
    "topology": ("topology", "which ranks run the target and which train the drafter (docs/topology.md)"),
    "evaluation": ("held-out evaluation", "tau by real speculative decoding on prompts never trained on"),
    "output": ("output, checkpoints and the Hub", "where the run writes, resumes and uploads"),
}


class SettingsParser(HfArgumentParser):
    """HfArgumentParser that lists each setting under the --help group its field's metadata names
    (`SETTING_GROUPS`; a setting with none lands under "options"), and reports a bad flag value as
    one ValueError line (the flag, what it expects, what it got) instead of printing the whole usage
    text and exiting."""

    def _add_dataclass_arguments(self, dtype):
        self.setting_groups = {key: self.add_argument_group(title, description) for key, (title, description) in SETTING_GROUPS.items()}
        super()._add_dataclass_arguments(dtype)

    def _parse_dataclass_field(self, parser, field):
        metadata = dict(field.metadata)
        group = metadata.pop("group", None)  # ours: not an argparse keyword
        field = copy.copy(field)
        field.metadata = types.MappingProxyType(metadata)
        super()._parse_dataclass_field(self.setting_groups[group] if group else parser, field)

    def error(self, message: str):
        raise ValueError(flag_error_line(message, "train_dflash.py"))


class ScriptParser(HfArgumentParser):
    """HfArgumentParser that reports a bad or missing flag as one ValueError line (`flag_error_line`) instead of
    printing the whole usage text and exiting: the scripts print it as their one `error: ...` line."""

    def error(self, message: str):
        raise ValueError(flag_error_line(message, os.path.basename(self.prog)))


def flag_error_line(message: str, script: str) -> str:
    """argparse's error message as one line: the flag, what it expects, what it got (or the flags missing, each
    named once, without its --x-y alias), and where the help is."""
    invalid = re.fullmatch(r"argument (\S+?)(?:/\S+)?: invalid (\w+) value: (.*)", message)
    boolean = re.fullmatch(r"argument (\S+?)(?:/\S+)?: Truthy value expected: got (.*) but expected one of (.*) \(case insensitive\)\.", message)
    if invalid:
        flag, kind, value = invalid.groups()
        message = f"{flag} expects {_EXPECTED.get(kind, kind)}, got {value}"
    elif boolean:
        flag, value, accepted = boolean.groups()
        message = f"{flag} expects true or false ({accepted}), got {value!r}"
    else:
        message = re.sub(r"(--[\w]+)/--[\w-]+", r"\1", re.sub(r"^argument (\S+?)(?:/\S+)?: ", r"\1: ", message))
    return f"{message}; see `python {script} --help`"


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


def check_yaml_values(values: dict, settings_class, path: str) -> dict:
    """The settings of a YAML file checked against `settings_class`'s field types, before they become
    the parser's defaults: argparse converts only string defaults, so a list where a number belongs
    (`block_size: [16]`) would pass unchecked and fail later with a traceback. Numbers for a float
    setting become floats, a scalar for a list setting a one-item list, numbers for a string setting
    strings, and a YAML list for a string setting its comma list (`layer_types`). Returns the
    checked values.

    Raises:
        ValueError: 'configs/x.yaml: block_size expects an integer, got [16]' for the first value of
            the wrong type (an empty value counts as wrong where the setting has no None).
    """
    hints = typing.get_type_hints(settings_class)
    checked = {}
    for key, value in values.items():
        kinds = typing.get_args(hints[key]) if typing.get_origin(hints[key]) in (typing.Union, types.UnionType) else (hints[key],)
        kind = next(k for k in kinds if k is not type(None))
        if value is None and type(None) in kinds:
            checked[key] = None
            continue
        if kind is str and isinstance(value, list):  # a comma list written as a YAML list (layer_types)
            checked[key] = ",".join(_checked(str, v, path, key, listed=True) for v in value)
        elif typing.get_origin(kind) is list:
            item = typing.get_args(kind)[0]
            checked[key] = [_checked(item, v, path, key, listed=True) for v in (value if isinstance(value, list) else [value])]
        else:
            checked[key] = _checked(kind, value, path, key)
    return checked


def _checked(kind, value, path: str, key: str, listed: bool = False):
    """`value` as a `kind` (int, float, str or bool), or ValueError naming the file and key."""
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:  # str: a number is taken as written (a revision "2", a device "0")
        ok = isinstance(value, (str, int, float)) and not isinstance(value, bool)
    if not ok:
        one, many = {bool: ("true or false", "trues or falses"), int: ("an integer", "integers"), float: ("a number", "numbers")}.get(
            kind, ("a string", "strings")
        )
        raise ValueError(f"{path}: {key} expects {'a list of ' + many if listed else one}, got {value!r}")
    return float(value) if kind is float else str(value) if kind is str else value
