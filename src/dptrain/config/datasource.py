"""`data.source=PATH`: the data factory picked from what PATH is, before anything starts.

- a folder written by `dptrain data prepare` (it holds ``manifest.json``): packed language-model rows,
  ``dptrain.data.packed:build_packed`` with ``data.kwargs.source=PATH``;
- a JSON-lines file (``.jsonl``, ``.ndjson``, ``.json``): fine-tuning or classification rows with dynamic
  padding and length-grouped batches under a token budget, ``dptrain.data.finetune:build_finetune``.

The config then names the factory and ``data.kwargs.source`` (``data.source`` is cleared), so the run's
``config.yaml`` says exactly what trained. Only the filesystem is read here (no torch, no data package).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dptrain.config.fields import Config, ConfigError, DataConfig

__all__ = ["FINETUNE_FACTORY", "PACKED_FACTORY", "resolve_data", "resolve_data_source"]

PACKED_FACTORY = "dptrain.data.packed:build_packed"
FINETUNE_FACTORY = "dptrain.data.finetune:build_finetune"
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
_MANIFEST_FORMAT = "dptrain-tokens"  # dptrain.data.prepare.FORMAT


def _factory_for(source: str) -> str:
    path = Path(source).expanduser()
    valid = ("a folder written by dptrain data prepare (packed pre-training) or a JSON-lines file "
             f"({', '.join(JSONL_SUFFIXES)}: fine-tuning/classification)")
    if path.is_dir():
        manifest = path / "manifest.json"
        if not manifest.is_file():
            hint = ("its dptrain data prepare did not finish: run it again" if (path / "plan.json").is_file()
                    else "prepare it first: dptrain data prepare FILES --tokenizer T --out DIR")
            raise ConfigError(f"data.source={source!r} is a folder without manifest.json; {hint}. Valid: {valid}")
        try:
            fmt = json.loads(manifest.read_text()).get("format")
        except (OSError, ValueError, AttributeError) as e:
            raise ConfigError(f"data.source={source!r}: cannot read its manifest.json ({e})") from None
        if fmt != _MANIFEST_FORMAT:
            raise ConfigError(f"data.source={source!r}: its manifest.json is not a dptrain data prepare manifest "
                              f"(format {fmt!r}, expected {_MANIFEST_FORMAT!r})")
        return PACKED_FACTORY
    if path.is_file():
        if path.suffix.lower() in JSONL_SUFFIXES:
            return FINETUNE_FACTORY
        raise ConfigError(f"data.source={source!r} is a {path.suffix or 'suffix-less'} file; valid: {valid}")
    raise ConfigError(f"data.source={source!r}: no such file or folder; valid: {valid}")


def resolve_data_source(cfg: Config) -> Config:
    """`cfg` with `data.source` turned into `data.factory` + `data.kwargs.source` (see `resolve_data`)."""
    data = resolve_data(cfg.data)
    return cfg if data is cfg.data else dataclasses.replace(cfg, data=data)


def resolve_data(data: DataConfig) -> DataConfig:
    """`data` with `source` turned into `factory` + `kwargs.source` (see the module); unchanged without one.
    A `factory` other than the default or the one the source picks is refused, naming both."""
    if data.source is None:
        return data
    factory = _factory_for(str(data.source))
    default = DataConfig()
    if data.factory not in (default.factory, factory):
        raise ConfigError(f"data.source={data.source!r} picks data.factory={factory}, but data.factory={data.factory} "
                          "is set too; give one of them")
    kwargs = dict(data.kwargs)
    if "source" in kwargs and kwargs["source"] != data.source:
        raise ConfigError(f"data.source={data.source!r} and data.kwargs.source={kwargs['source']!r} disagree; "
                          "give one of them")
    kwargs["source"] = str(data.source)
    return dataclasses.replace(data, factory=factory, kwargs=kwargs, source=None)
