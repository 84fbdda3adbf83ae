"""`--help` of every dflash command: a line of text for every flag and every default shown (issue 31 #7)."""

from __future__ import annotations

import argparse

import pytest
from dflash.extract.cli import build_parser as extract_parser
from dflash.tools import demo, shards_cli
from dflash.tools.tokenize import build_parser as tokenize_parser
from dflash.train import cli as train_cli
from dflash.train.config import flat_keys


def _parsers() -> dict[str, argparse.ArgumentParser]:
    parsers = {
        "dflash-extract": extract_parser(),
        "dflash-train": train_cli._train_parser(),
        "dflash-train export": train_cli._export_parser(),
        "dflash-tokenize": tokenize_parser(),
        "dflash-demo": demo._parser(),
    }
    shards = shards_cli._parser()
    for action in shards._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if name != "plan":  # forwarded to dflash-extract --dry-run
                    parsers[f"dflash-shards {name}"] = sub
    return parsers


@pytest.mark.parametrize("name", sorted(_parsers()))
def test_every_flag_has_text_and_its_default(name: str) -> None:
    parser = _parsers()[name]
    boolean = (argparse._StoreTrueAction, argparse._HelpAction)
    preset_keys = set(flat_keys()) - {"cache", "out", "resume"}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        text = parser.formatter_class(prog=parser.prog)._get_help_string(action)
        where = f"{name} {'/'.join(action.option_strings) or action.dest}"
        assert (action.help or "").strip(), f"{where} has no help text"
        if action.default is argparse.SUPPRESS:  # dflash-train: the preset holds the defaults
            has_default = action.dest in preset_keys
        else:
            has_default = action.default is not None and not isinstance(action, boolean)
        if action.option_strings and not action.required and has_default:
            assert "default" in text, f"{where}: the help does not show the default: {text!r}"


def test_train_help_shows_the_paper_recipe_and_tiny() -> None:
    """dflash-train's parser has no defaults of its own (flags override --config): the help shows the
    paper preset's values, and tiny's where they differ."""
    text = train_cli._train_parser().format_help()
    flat = " ".join(text.split())
    for shown in (
        "--lr LR AdamW peak learning rate (default: 0.0006; --preset tiny: 0.001)",
        "--epochs EPOCHS passes over the training rows (default: 6, or as many as make 6,000 batches, at most "
        "10; --resume: its run's; --preset paper: 6; --preset tiny: 2)",
        "(default: 16; --preset tiny: 4)",
        "anchors sampled per sequence (default: 512; --preset tiny: 8)",
        "drafter decoder layers (default: 5; --preset tiny: 1)",
        "(default: 0.04)",
    ):
        assert shown in flat, shown


def test_defaults_said_in_words_are_the_ones_the_recipe_leaves_open() -> None:
    """A default in words stands for a value start-up settles: the recipe must leave it None, else the help
    would hide the value a run really gets."""
    recipe = train_cli.PRESETS["default"]("CACHE", "OUT").to_flat()
    for key in train_cli.DEFAULTS_IN_WORDS:
        assert key in recipe and recipe[key] is None, key


def test_extract_help_names_the_column_flags() -> None:
    flat = " ".join(extract_parser().format_help().split())
    assert "--input-ids-column INPUT_IDS_COLUMN dataset column of token id lists (default: input_ids)" in flat
    assert "supervised (assistant) tokens (default: loss_mask)" in flat
