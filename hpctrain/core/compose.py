"""Compose `conf/` with command-line overrides into one typed, resolved config.

Hydra does the composing and OmegaConf validates every value against the schema
(hpctrain.core.schema); what comes out is the schema's own dataclass tree, `Config`, the one shape of
the configuration from the command line to the rank. This module finds `conf/` (checkout or installed
package) and turns Hydra's and OmegaConf's errors into messages that name the key and the fix.
"""
from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hpctrain.core import hf_format as hf
from hpctrain.core.schema import Choice, Config, ModelConfig


class ConfigError(ValueError):
    """A config that must not start: the message says what is wrong and how to fix it."""


# Keys that were renamed: old -> new. The old one is refused with the new one as the fix.
RENAMED = {"checkpoint.async": "checkpoint.async_save"}


def _renamed(overrides: Sequence[str]) -> list[str]:
    out = []
    for ov in overrides:
        key, eq, value = ov.lstrip("+~").partition("=")
        if key in RENAMED:
            out.append(f"{key} is now {RENAMED[key]}. Fix: {RENAMED[key]}{eq}{value}")
    return out


def conf_dir() -> Path:
    here = Path(__file__).resolve().parent.parent  # the hpctrain package
    for cand in (here.parent / "conf", here / "conf"):  # checkout, then installed wheel
        if (cand / "config.yaml").is_file():
            return cand
    raise ConfigError(f"cannot find hpctrain's conf/ directory next to {here}; reinstall hpctrain")


def register() -> None:
    """Register the schema with Hydra's ConfigStore; conf/config.yaml names it first in its defaults."""
    # Hydra (~0.3 s) composes on the login node only: every rank just load()s config.yaml
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="hpctrain_schema", node=Config)


def compose(overrides: Sequence[str] = (), resolve_paths: bool = True) -> Config:
    """The config `python -m hpctrain <overrides>` would run, validated, resolved and typed."""
    renamed = _renamed(overrides)
    if renamed:
        raise ConfigError("\n".join(renamed))
    # Hydra (~0.3 s) composes on the login node only: every rank just load()s config.yaml
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=list(overrides))
        OmegaConf.resolve(cfg)
    except Exception as e:  # Hydra wraps OmegaConf errors in several layers; show the root cause.
        bad = [msg for _, msg in bad_choices(overrides)]
        if bad:  # Hydra stops at the first; name every value outside its choice's list at once
            raise ConfigError("\n".join(bad) if len(bad) == 1 else
                              f"{len(bad)} values are not allowed:\n" + "\n".join(f"  - {b}" for b in bad)) from None
        raise ConfigError(explain(e, overrides)) from None
    unknown = _extra_keys(cfg, _schema_keys(()))
    if unknown:
        raise ConfigError(_unknown_key(unknown[0]))
    if cfg.model.name == "hf":  # model=hf: the shape is the one model.init_from's config.json gives
        if not cfg.model.init_from:
            raise ConfigError("model=hf takes the model's shape from a Hugging Face directory. "
                              "Fix: add model.init_from=<directory with config.json and *.safetensors>")
        try:
            given = hf.read_config(cfg.model.init_from)
            keys = hf.model_keys(given)
            # training defaults (the balancing loss's coefficient) only where the command line sets none
            said = {o.lstrip("+").split("=", 1)[0] for o in overrides}
            keys.update({k: v for k, v in hf.training_keys(given).items() if f"model.{k}" not in said})
            for k, v in keys.items():
                OmegaConf.update(cfg, f"model.{k}", v, merge=False)
        except (hf.HFError, OmegaConfBaseException) as e:
            raise ConfigError(explain(e, ()) if isinstance(e, OmegaConfBaseException) else str(e)) from None
    if resolve_paths:
        if not str(cfg.run.dir).strip():  # abspath would make it the current directory: the user's
            raise ConfigError("run.dir is empty. Fix: name the run's directory, e.g. run.dir=outputs/<name>")
        cfg.run.dir = os.path.abspath(os.path.expanduser(cfg.run.dir))
    try:
        out = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:  # a mandatory value left unset, e.g. a data source's path
        raise ConfigError(explain(e, overrides)) from None
    assert isinstance(out, Config)
    return out


def load(path: str | os.PathLike) -> Config:
    """A run directory's resolved config.yaml, validated against the schema again."""
    try:
        raw = OmegaConf.load(path)
        old = [k for k in RENAMED if OmegaConf.select(raw, k, default=None) is not None]
        if old:
            raise ConfigError(f"{path}: " + "; ".join(f"{k} is now {RENAMED[k]}" for k in old)
                              + ". Fix: rename the key" + "s" * (len(old) > 1) + " in that file")
        out = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), raw))
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{path}: {explain(e, ())}") from None
    assert isinstance(out, Config)
    return out


def model_config(values: dict) -> ModelConfig:
    """A ModelConfig from plain values (a checkpoint's record), validated against the schema."""
    try:
        out = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), values))
    except OmegaConfBaseException as e:
        raise ConfigError(f"model: {explain(e, ())}") from None
    assert isinstance(out, ModelConfig)
    return out


def to_yaml(cfg: Config) -> str:
    """The config as config.yaml holds it (load() reads it back to an equal Config)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    """Plain JSON-ready values (choices as their strings): for metrics, trackers and checkpoint records."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)


def explain(e: BaseException, overrides: Sequence[str]) -> str:
    # Hydra wraps OmegaConf's error, which wraps Python's: the OmegaConf one knows the key.
    chain, cur = [], e
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    omega = [x for x in chain if isinstance(x, OmegaConfBaseException)]
    keyed = [x for x in omega if getattr(x, "full_key", None)]
    root = keyed[0] if keyed else (omega[-1] if omega else chain[-1])
    msg = str(root)
    full_key = getattr(root, "full_key", None) or _field(msg, "full_key")
    for ov in overrides:  # the value as the user typed it
        k, _, v = ov.lstrip("+~").partition("=")
        if full_key and k == full_key:
            typed = v
            break
    else:
        typed = None
    name = type(root).__name__

    if "not in" in msg and ("Key '" in msg) or name == "ConfigKeyError":
        key = full_key or _quoted(msg)
        return _unknown_key(key)
    if name in ("ValidationError", "UnsupportedValueType") and full_key and _choice_of(full_key):
        return _not_a_choice(full_key, typed if typed is not None else _quoted(msg))
    if name in ("ValidationError", "UnsupportedValueType") and full_key:
        expected = _expected_type(full_key)
        value = typed if typed is not None else _quoted(msg)
        return (f"{full_key}: {value!r} is not a valid {expected}. "
                f"Fix: give {_article(expected)} {expected}, e.g. {full_key}={_example(expected)}")
    missing = re.search(r"Could not find '([\w-]+)/([^']*)'", msg)
    if missing and (conf_dir() / missing.group(1)).is_dir():
        group, name = missing.groups()
        presets = sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))
        # the same words in another order (tiny_moe for moe_tiny) before spelling's nearest
        words = sorted(name.lower().replace("-", "_").split("_"))
        near = [p for p in presets if sorted(p.split("_")) == words] or difflib.get_close_matches(name, presets, n=1)
        plus = "+" if group == "experiment" else ""
        return (f"{plus}{group}={name}: no such preset (conf/{group}/{name}.yaml). Presets of {group}: "
                f"{', '.join(presets)}. Fix: {plus}{group}={(near or presets)[0]}")
    if "Could not find" in msg or "Could not override" in msg or "Could not load" in msg:
        return msg.split("Config search path")[0].strip()
    if name in ("LexerNoViableAltException", "OverrideParseException") or "missing EQUAL" in msg \
            or "no viable alternative" in msg or "mismatched input" in msg:
        bad = next((o for o in overrides if "=" not in o or any(c in o for c in "~$'\"")), None)
        return (f"cannot parse the override {bad!r}: write key=value, and quote a value holding special "
                "characters, e.g. \"run.dir='~/runs/a'\"") if bad else f"cannot parse the overrides: {msg}"
    if "MissingMandatoryValue" in name or "Missing mandatory value" in msg:
        return f"{full_key} must be set. Fix: add {full_key}=<value> to the command line"
    return f"{name}: {msg}"


def _choice_of(key: str):
    """The Choice enum a schema key takes its values from, or None."""
    node = _schema_keys(key.split(".")[:-1])
    if not isinstance(node, DictConfig) or key.split(".")[-1] not in node:
        return None
    t = node._get_node(key.split(".")[-1])._metadata.ref_type
    return t if isinstance(t, type) and issubclass(t, Choice) else None


def _not_a_choice(key: str, value) -> str:
    allowed = _choice_of(key).values()
    near = [a for a in allowed if a.lower() == str(value).lower()] or difflib.get_close_matches(str(value), allowed, n=1)
    return f"{key}={value} is not one of {', '.join(allowed)}. Fix: {key}={(near or allowed)[0]}"


def bad_choices(overrides: Sequence[str]) -> list[tuple[str, str]]:
    """(override, message) for every `key=value` override whose key is a choice and whose value is
    not one of its values."""
    out = []
    for ov in overrides:
        key, eq, value = ov.lstrip("+~").partition("=")
        choice = _choice_of(key) if eq else None
        if choice is not None and value not in choice.values():
            out.append((ov, _not_a_choice(key, value)))
    return out


def _extra_keys(cfg: DictConfig, schema: DictConfig, prefix: str = "") -> list[str]:
    """Keys a `+key=value` override added that the schema does not know (Hydra lets `+` through)."""
    extra = []
    for key in cfg.keys():
        full = f"{prefix}{key}"
        if key not in schema:
            extra.append(full)
        elif isinstance(schema[key], DictConfig) and OmegaConf.get_type(schema, key) is not dict:
            if isinstance(cfg[key], DictConfig) and len(schema[key]) > 0:
                extra += _extra_keys(cfg[key], schema[key], full + ".")
    return extra


def _field(msg: str, name: str) -> str | None:
    m = re.search(rf"{name}: (\S+)", msg)
    return m.group(1) if m else None


def _quoted(msg: str) -> str:
    m = re.search(r"'([^']*)'", msg)
    return m.group(1) if m else msg


def _schema_keys(path: Sequence[str]):
    node = OmegaConf.structured(Config)
    for part in path:
        if not isinstance(node, DictConfig) or part not in node:
            return None
        node = node[part]
    return node


def _unknown_key(key: str) -> str:
    parts = key.split(".")
    parent = _schema_keys(parts[:-1])
    if parent is None or not isinstance(parent, DictConfig):
        return f"unknown key '{key}'. Run `python -m hpctrain --cfg` to see every key."
    known = list(parent.keys())
    near = difflib.get_close_matches(parts[-1], known, n=1)
    prefix = ".".join(parts[:-1])
    hint = f" Did you mean '{prefix + '.' if prefix else ''}{near[0]}'?" if near else ""
    return (f"unknown key '{key}'.{hint} Keys of {prefix or 'the config'}: {', '.join(known)}")


def _expected_type(key: str) -> str:
    node = OmegaConf.structured(Config)
    parts = key.split(".")
    try:
        parent = OmegaConf.select(node, ".".join(parts[:-1])) if len(parts) > 1 else node
        ref = parent._get_node(parts[-1])
        t = getattr(ref, "_metadata").ref_type
        return getattr(t, "__name__", str(t)).replace("Optional[", "").rstrip("]")
    except Exception:
        return "value of the right type"


def _example(typename: str) -> str:
    return {"int": "8", "float": "0.001", "bool": "true", "str": "name"}.get(typename, "...")


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"
