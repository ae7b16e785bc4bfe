"""Recipes: named, versioned job definitions in TOML (``specbatch run --recipe FILE INPUT``).

A recipe supplies the values of ``specbatch run``'s options; a flag given on the command line
wins over the recipe, and the recipe wins over the built-in defaults. Every table and key is
optional except ``name`` and ``version``::

    name = "code_edit"        # letters, digits, ".", "_", "-"; written to OUT.config.json
    version = 1               # bump it when a change must not resume an older run's work
    description = "..."

    [model]        name, dtype, device, max_batch_size, max_model_len
    [speculation]  method, k (or num_speculative_tokens, as --num-speculative-tokens),
                   prompt_lookup_min, prompt_lookup_max, draft_model
    [sampling]     temperature, top_p, top_k, seed (the run seed, --seed), max_tokens,
                   min_tokens, stop, stop_token_ids, ignore_eos, logprobs, n,
                   repetition_penalty, presence_penalty, frequency_penalty, min_p,
                   json_schema (a schema file, as --json-schema; a relative path is
                   read from the recipe's folder)
    [input]        prompt_field, id_field, template (exclusive with prompt_field)

Keys are the option names with ``_`` for ``-`` (``[model] name`` is ``--model``). Values get
the checks the flags get; an unknown table or key is an error, so a typo never passes silently
(with the nearest key, as a record's misspelled field gets).
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from dataclasses import dataclass, fields
from types import MappingProxyType

from specbatch.config import (MAX_INT, MIN_INT, SAMPLING_FIELDS, EngineConfig, SamplingParams,
                              SpecConfig)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

# table -> {recipe key: ``specbatch run`` parameter name}
SECTIONS = MappingProxyType({
    "model": {"name": "model", "dtype": "dtype", "device": "device",
              "max_batch_size": "max_batch_size",
              "max_model_len": "max_model_len"},
    "speculation": {"method": "method", "k": "k", "num_speculative_tokens": "k",
                    "prompt_lookup_min": "prompt_lookup_min",
                    "prompt_lookup_max": "prompt_lookup_max", "draft_model": "draft_model"},
    # every sampling field with a flag (logit_bias and response_format are per record; a
    # recipe's JSON schema is a file: json_schema = "schema.json")
    "sampling": {**{name: name for name in SAMPLING_FIELDS
                    if name not in ("logit_bias", "response_format")},
                 "json_schema": "json_schema"},
    "input": {"prompt_field": "prompt_field", "id_field": "id_field", "template": "template"},
})
TOP_LEVEL = ("name", "version", "description")
# other names a recipe key is written under (the CLI's long flag) -> the key
ALIASES = {"num_speculative_tokens": "k"}
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class Recipe:
    """A loaded recipe.

    options: ``specbatch run`` parameter name -> value (``{"k": 5, "max_tokens": 128, ...}``),
        only the keys the recipe sets; lists stay lists (``stop``).
    """

    name: str
    version: int | str
    description: str
    path: str
    options: dict

    @property
    def identity(self) -> dict:
        """What the output's config records: ``{"name": ..., "version": ...}``."""
        return {"name": self.name, "version": self.version}


def load_recipe(path: str | os.PathLike) -> Recipe:
    """Read and check a recipe file. Raises ``ValueError`` naming the file and the bad key."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"recipe {str(path)!r}: no such file") from None
    except OSError as e:
        raise ValueError(f"recipe {str(path)!r}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"recipe {str(path)!r}: invalid TOML: {e}") from None
    recipe = parse_recipe(data, str(path))
    schema = recipe.options.get("json_schema")
    if schema is not None and not os.path.isabs(schema):  # beside the recipe, not the cwd
        recipe.options["json_schema"] = os.path.join(os.path.dirname(os.fspath(path)), schema)
    return recipe


def parse_recipe(data: dict, path: str = "<recipe>") -> Recipe:
    """Check a parsed recipe (``tomllib`` output); see ``load_recipe``."""
    def fail(msg: str) -> ValueError:
        return ValueError(f"recipe {path!r}: {msg}")

    unknown = [k for k in data if k not in TOP_LEVEL and k not in SECTIONS]
    if unknown:
        raise fail(f"unknown key {unknown[0]!r}{_did_you_mean(unknown[0], (*TOP_LEVEL, *SECTIONS))}"
                   f"; expected {', '.join(TOP_LEVEL)} or the tables [{'], ['.join(SECTIONS)}]")
    for key in ("name", "version"):
        if key not in data:
            raise fail(f"{key} is missing (a recipe starts with name = \"...\" and version = 1)")
    name, version = data.get("name"), data.get("version")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise fail(f"name={name!r}: expected letters, digits, '.', '_' or '-'")
    if isinstance(version, bool) or not (isinstance(version, int) and version >= 0
                                         or isinstance(version, str) and version.strip()):
        raise fail(f"version={version!r}: expected an integer >= 0 or a version string")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise fail(f"description must be a string, got {description!r}")

    options: dict = {}
    for table, keys in SECTIONS.items():
        values = data.get(table, {})
        if not isinstance(values, dict):
            raise fail(f"{table} must be a table ([{table}]), got {values!r}")
        for key, value in values.items():
            if key not in keys:
                raise fail(f"unknown key [{table}] {key!r}{_did_you_mean(key, keys)}; expected "
                           f"one of {', '.join(k for k in keys if k not in ALIASES)}")
            if keys[key] in options:  # an alias and its key both given
                same = [k for k in values if keys.get(k) == keys[key]]
                raise fail(f"[{table}] {' and '.join(same)} set the same value; keep one")
            options[keys[key]] = value
    try:
        _check(options)
    except ValueError as e:
        raise fail(_as_written(str(e))) from None
    if isinstance(options.get("stop"), str):  # one stop string, as a record may give it
        options["stop"] = [options["stop"]]
    return Recipe(name, version, description, path, options)


def _did_you_mean(key: str, known) -> str:
    """``"; did you mean 'temperature'?"``-style hint for a misspelled key, or ""."""
    close = difflib.get_close_matches(key.lower(), list(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


# what the checks call a value -> the recipe key that sets it
_KEYS = {**{param: f"[{table}] {key}" for table, keys in SECTIONS.items()
            for key, param in keys.items() if key not in ALIASES},
         "num_speculative_tokens": "[speculation] k"}


def _as_written(message: str) -> str:
    """Name the value in a check's message by the recipe's key: ``num_speculative_tokens=99:
    expected ...`` -> ``[speculation] k=99: expected ...``, ``model=''`` -> ``[model] name=''``."""
    name, sep, rest = message.partition("=")
    return f"{_KEYS[name]}={rest}" if sep and name in _KEYS else message


def _check(options: dict) -> None:
    """The checks ``specbatch run`` applies to the same values given as flags."""
    from specbatch.io.records import template_fields

    for key in ("model", "prompt_field", "id_field", "json_schema"):
        if key in options and not (isinstance(options[key], str) and options[key]):
            raise ValueError(f"{key}={options[key]!r}: expected a non-empty string")
    if "template" in options:
        template_fields(options["template"])
        if "prompt_field" in options:
            raise ValueError("[input] has both prompt_field and template; keep one")
    seed = options.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not MIN_INT <= seed <= MAX_INT):
        raise ValueError(f"seed={seed!r}: expected an integer that fits in 64 bits")
    if "stop" in options and not isinstance(options["stop"], (list, str)):
        raise ValueError(f"stop={options['stop']!r}: expected a string or a list of strings")
    if "stop_token_ids" in options and not isinstance(options["stop_token_ids"], list):
        raise ValueError(f"stop_token_ids={options['stop_token_ids']!r}: expected a list")
    SamplingParams.from_dict({k: v for k, v in options.items()
                              if k in SAMPLING_FIELDS and k != "seed"})
    spec_keys = {"method": "method", "k": "num_speculative_tokens",
                 "prompt_lookup_min": "prompt_lookup_min", "prompt_lookup_max": "prompt_lookup_max",
                 "draft_model": "draft_model"}
    SpecConfig(**{spec_keys[k]: v for k, v in options.items() if k in spec_keys})
    engine_keys = {f.name for f in fields(EngineConfig)} & set(SECTIONS["model"].values())
    EngineConfig(**{k: v for k, v in options.items() if k in engine_keys})


__all__ = ["Recipe", "load_recipe", "parse_recipe", "SECTIONS"]
