"""Typed recipes: YAML files loaded into dataclasses, with every problem reported at once.

A recipe is a plain ``@dataclass`` whose fields are all declared with :func:`knob`
(a default plus a help line). :func:`load_recipe` reads a YAML file, applies
``--set a.b=value`` overrides, checks each value against the field's annotation,
runs each dataclass's optional ``check()`` for cross-field rules, and raises one
:class:`RecipeError` listing everything that is wrong, so a user can fix a recipe
in a single edit instead of one crash per run. A recipe file may build on another
with ``extends: OTHER.yaml`` (a path relative to the file): its own keys are merged
over the other's, key by key at every depth, so a family of experiments keeps one
body and each file says only what it changes. :func:`save_recipe` writes the
resolved recipe next to a run for provenance; :func:`describe_fields` and
:func:`format_fields` turn the schema into ``--help`` text.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import functools
import os
import re
import textwrap
import types
import typing
from collections.abc import Hashable
from pathlib import Path, PurePath
from typing import Any, Literal, Sequence, TypeVar, Union

import yaml

from ecomla.errors import UserError

T = TypeVar("T")
MISSING = dataclasses.MISSING
_INVALID = object()  # what converters return for a rejected value (None is a real value)


def knob(default=MISSING, *, help: str, default_factory=MISSING) -> dataclasses.Field:
    """A recipe field: ``dataclasses.field`` whose help text is mandatory, so --help can list it."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"help": help})


class RecipeError(UserError, ValueError):
    """Everything wrong with one recipe; ``problems`` holds 'dotted.path: message' strings."""

    def __init__(self, problems: Sequence[str], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        super().__init__(self.problems, source)  # keeps pickling/copy able to rebuild it

    def __str__(self) -> str:
        lines = "\n".join(f"  - {p}" for p in self.problems)
        return f"{self.source or 'recipe'} has {len(self.problems)} problem(s):\n{lines}"


class _Loader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (in a recipe they are nearly always paste errors)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # '<<' merge keys may legitimately repeat
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


# PyYAML implements YAML 1.1, where a float needs a dot: a learning rate written
# as 1e-4 would otherwise load as the *string* '1e-4' and fail as "expected float".
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


class _Ctx:
    """Problems collected during one load, plus which paths came from --set."""

    def __init__(self, set_leaves: set[str] | None = None, set_created: set[str] | None = None):
        self.problems: list[str] = []
        self.set_leaves = set_leaves if set_leaves is not None else set()  # keys given to --set
        self.set_created = set_created if set_created is not None else set()  # mappings --set created

    def trial(self) -> _Ctx:  # scratch context: try a union member without reporting
        return _Ctx(self.set_leaves, self.set_created)

    def report(self, path: str, msg: str) -> None:
        if not path:
            self.problems.append(msg)
            return
        from_set = path in self.set_created or any(
            path == leaf or path.startswith((leaf + ".", leaf + "[")) for leaf in self.set_leaves)
        self.problems.append(f"{path}{' (from --set)' if from_set else ''}: {msg}")


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _got(value: Any) -> str:
    """'str 'abc'', 'bool true', 'null', ... : the offending value as a user wrote it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"bool {'true' if value else 'false'}"
    if isinstance(value, dict):
        return "mapping"
    if isinstance(value, (list, tuple)):
        return "list"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


# bool is an int subclass in Python, so int and float must refuse YAML's true/false explicitly.
_SCALARS = {
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
}


def _type_name(tp: Any) -> str:
    """A short YAML-flavoured name for an annotation; raises TypeError for ones we cannot check."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return "any"
    if tp is None or tp is type(None):
        return "null"
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " | ".join(repr(m.value) for m in tp)
    if dataclasses.is_dataclass(tp):
        return "mapping"
    if origin is tuple:  # only homogeneous tuples: YAML lists have no per-position types
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"unsupported recipe field type {tp!r}; use tuple[X, ...]")
        return f"tuple[{_type_name(args[0])}, ...]"
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    if tp in (list, tuple, dict) or tp in _SCALARS:
        return tp.__name__
    if isinstance(tp, type) and issubclass(tp, PurePath):
        return "path"
    raise TypeError(f"unsupported recipe field type: {tp!r}")


@functools.lru_cache(maxsize=None)
def _schema(cls: type) -> tuple[tuple[dataclasses.Field, ...], dict[str, Any]]:
    """(init fields, resolved hints) of a recipe class, checked once. Schema mistakes are the
    author's, not the user's: they raise TypeError up front, not RecipeError when a key is set."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)  # resolves string annotations (`from __future__ import annotations`)
    fields = tuple(f for f in dataclasses.fields(cls) if f.init)
    for f in fields:
        if "help" not in f.metadata:
            raise TypeError(f"{cls.__qualname__}.{f.name}: declare recipe fields with knob(..., help=...)")
        _type_name(hints[f.name])
    return fields, hints


def _not_one_of(value: Any, choices: Sequence[Any], path: str, ctx: _Ctx) -> Any:
    text = repr(value) if not isinstance(value, (dict, list, tuple)) else _got(value)
    msg = f"{text} is not one of {', '.join(repr(c) for c in choices)}"
    strings = [c for c in choices if isinstance(c, str)]
    close = difflib.get_close_matches(value, strings, n=1, cutoff=0.6) if isinstance(value, str) else []
    ctx.report(path, msg + (f"; did you mean {close[0]!r}?" if close else ""))
    return _INVALID


def _convert(value: Any, tp: Any, path: str, ctx: _Ctx) -> Any:
    """Check `value` against annotation `tp`; return the typed value or _INVALID (problems reported)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # plain Optional[X]: X's own, more precise, problems
            return _convert(value, options[0], path, ctx)
        for option in options:  # first member that accepts the value wins, in declaration order
            out = _convert(value, option, path, ctx.trial())
            if out is not _INVALID:
                return out
    elif origin is Literal:
        for choice in args:
            if value == choice and type(value) is type(choice):  # so true never matches 1
                return choice
        return _not_one_of(value, args, path, ctx)
    elif isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        for member in tp:
            if member.value == value and type(member.value) is type(value):
                return member
        return _not_one_of(value, [m.value for m in tp], path, ctx)
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, tp):  # an instance in `data=` is re-validated like YAML would be
            value = recipe_to_dict(value)
        if isinstance(value, dict):
            return _build(tp, value, path, ctx)
    elif origin in (list, tuple) or tp in (list, tuple):
        if isinstance(value, (list, tuple)):
            item_tp = args[0] if args else Any
            items = [_convert(v, item_tp, f"{path}[{i}]", ctx) for i, v in enumerate(value)]
            if any(item is _INVALID for item in items):
                return _INVALID
            return tuple(items) if (origin or tp) is tuple else items
    elif origin is dict or tp is dict:
        if isinstance(value, dict):
            key_tp, value_tp = args or (Any, Any)
            out, ok = {}, True
            for k, v in value.items():
                sub = _join(path, k)
                key = _convert(k, key_tp, sub, ctx.trial())
                if key is _INVALID:
                    ctx.report(sub, f"invalid key: expected {_type_name(key_tp)}, got {_got(k)}")
                item = _convert(v, value_tp, sub, ctx)
                ok = ok and key is not _INVALID and item is not _INVALID
                out[key] = item
            return out if ok else _INVALID
    elif tp in _SCALARS:
        if _SCALARS[tp](value):
            return tp(value)  # only changes anything for float: 3 -> 3.0
    elif tp is None or tp is type(None):
        if value is None:
            return None
    elif isinstance(tp, type) and issubclass(tp, PurePath):
        if isinstance(value, (str, PurePath)):
            return tp(value)
    else:  # unreachable for classes that passed _schema
        raise TypeError(f"{path}: unsupported recipe field type {tp!r}")
    ctx.report(path, f"expected {_type_name(tp)}, got {_got(value)}")
    return _INVALID


def _build(cls: type, data: dict, path: str, ctx: _Ctx) -> Any:
    """Build one dataclass from a mapping; its check() runs only if its whole subtree was clean."""
    fields, hints = _schema(cls)
    names = [f.name for f in fields]
    start = len(ctx.problems)
    expand = getattr(cls, "expand_raw", None)  # a recipe class may fill keys from named presets first
    if callable(expand):
        data = expand(data)
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(names)}"
            ctx.report(_join(path, key), f"unknown key; {hint}")
    kwargs = {}
    for f in fields:
        sub = _join(path, f.name)
        if f.name in data:
            value = _convert(data[f.name], hints[f.name], sub, ctx)
            if value is not _INVALID:
                kwargs[f.name] = value
        elif f.default is MISSING and f.default_factory is MISSING:
            ctx.report(sub, "required key is missing")
        # otherwise the dataclass's own default / default_factory applies
    if len(ctx.problems) > start:
        return _INVALID
    def report(messages) -> None:
        for msg in messages:
            key, sep, rest = msg.partition(": ")
            # 'field: msg' / 'field.sub: msg' are relative to this dataclass; anything else is bare.
            if sep and re.fullmatch(r"[\w.\[\]]+", key) and re.split(r"[.\[]", key, maxsplit=1)[0] in names:
                ctx.report(_join(path, key), rest)
            else:
                ctx.report(path, msg)

    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as exc:  # a __post_init__ that validates on its own (`problems`: per field)
        report(getattr(exc, "problems", None) or [str(exc)])
        return _INVALID
    check = getattr(obj, "check", None)
    if callable(check):
        report(check() or ())
    return obj if len(ctx.problems) == start else _INVALID


def _yaml_error(exc: yaml.YAMLError) -> str:
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"invalid YAML{where}: {problem or ' '.join(str(exc).split())}"


def merged(base: dict, over: dict) -> dict:
    """A copy of `base` with `over` merged in, key by key at every depth (a non-dict value replaces)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


EXTENDS = "extends"  # the top-level key of a recipe file that names the recipe it builds on


def _read_yaml(path: str | os.PathLike, chain: tuple[Path, ...] = ()) -> dict:
    """The mapping of one recipe file, with its `extends:` chain resolved (`chain`: the files that extend it)."""
    where = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.load(fh, Loader=_Loader)
    except FileNotFoundError:
        msg = "file not found"
    except (OSError, UnicodeDecodeError) as exc:
        msg = f"cannot read file: {getattr(exc, 'strerror', None) or exc}"
    except yaml.YAMLError as exc:
        msg = _yaml_error(exc)
    else:
        if data is None:  # an empty file is an empty recipe
            return {}
        if isinstance(data, dict):
            return _resolve_extends(data, Path(path), chain) if EXTENDS in data else data
        msg = f"top level must be a mapping of keys, got {_got(data)}"
    raise RecipeError([f"{where}: {msg}"], where)


def _resolve_extends(data: dict, path: Path, chain: tuple[Path, ...]) -> dict:
    """`data` (the file `path`) merged over the recipe its `extends:` names, itself resolved the same way."""
    where, parent = os.fspath(path), data.pop(EXTENDS)
    if not isinstance(parent, str) or not parent.strip():
        raise RecipeError([f"{where}: {EXTENDS}: give the path of the recipe this one builds on, relative to this "
                           f"file (e.g. extends: base.yaml), got {_got(parent)}"], where)
    chain = (*chain, path.resolve())
    target = path.parent / parent
    if target.resolve() in chain:
        cycle = " -> ".join(os.fspath(p) for p in (*chain, target.resolve()))
        raise RecipeError([f"{where}: {EXTENDS}: {parent!r} closes a loop ({cycle}); a recipe cannot build on "
                           "itself"], where)
    try:
        base = _read_yaml(target, chain)
    except RecipeError as err:
        raise RecipeError([f"{where}: {EXTENDS}: {parent!r}: {p}" for p in err.problems], where) from None
    return merged(base, data)


def _apply_overrides(raw: dict, overrides: Sequence[str], ctx: _Ctx) -> None:
    """Apply 'a.b.c=value' overrides in order, creating missing mappings on the way."""
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not sep or not all(parts):
            ctx.problems.append(f"--set {item!r}: expected KEY=VALUE")
            continue
        try:
            value = yaml.load(text, Loader=_Loader)  # so '64' -> int, 'null' -> None, '[1,2]' -> list
        except yaml.YAMLError as exc:
            ctx.problems.append(f"--set {item!r}: {_yaml_error(exc)}")
            continue
        node = raw
        for depth, part in enumerate(parts[:-1], start=1):
            here = ".".join(parts[:depth])
            if node.get(part) is None:
                node[part] = {}
                ctx.set_created.add(here)
            elif not isinstance(node[part], dict):
                ctx.problems.append(
                    f"{key} (from --set): cannot set a key inside {here!r}, which holds {_got(node[part])}")
                break
            node = node[part]
        else:
            node[parts[-1]] = value
            ctx.set_leaves.add(key)


def load_recipe(cls: type[T], path: str | os.PathLike | None = None, *, data: dict | None = None,
                overrides: Sequence[str] = ()) -> T:
    """Load, override, validate and build a recipe; raise one RecipeError with every problem."""
    _schema(cls)
    if path is not None and data is not None:
        raise TypeError("load_recipe: pass path or data, not both")
    if isinstance(overrides, str):
        raise TypeError("load_recipe: overrides must be a sequence of 'KEY=VALUE' strings")
    source = os.fspath(path) if path is not None else "recipe"
    raw = _read_yaml(path) if path is not None else copy.deepcopy(data) if data is not None else {}
    if not isinstance(raw, dict):
        raise RecipeError([f"top level must be a mapping of keys, got {_got(raw)}"], source)
    ctx = _Ctx()
    _apply_overrides(raw, overrides, ctx)
    obj = _build(cls, raw, "", ctx)
    if ctx.problems:
        raise RecipeError(ctx.problems, source)
    return obj


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    return value


def recipe_to_dict(obj: Any) -> dict:
    """A plain, yaml.safe_dump-able dict of a recipe instance (loadable back with load_recipe)."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"recipe_to_dict expects a dataclass instance, got {type(obj).__name__}")
    return _plain(obj)


def _field_default(f: dataclasses.Field, parent_default: Any) -> Any:
    """A field's default: the parent's default instance's value where there is one (it may differ from the class
    defaults), else the field's own; MISSING for a required key."""
    if parent_default is not None:
        return getattr(parent_default, f.name)
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def asks_the_same(old: dict, new: dict, cls: type, *, defaults: Any = None) -> bool:
    """Whether `old`, a resolved recipe of `cls` as an earlier ecomla wrote it (`recipe_to_dict`), asks for what
    `new`, this version's, asks for: every key of `old` has `new`'s value, and every key only `new` has (a knob
    added since) is at its default, which by this project's rule is what the code did before the knob existed.
    A key only `old` has (removed or renamed since) is a difference; a key left out of both (a path the caller
    drops before hashing) is not compared. Lists of recipe classes are compared item by item."""
    fields, hints = _schema(cls)
    if set(old) - {f.name for f in fields}:
        return False
    for f in fields:
        if f.name not in new:
            if f.name in old:
                return False
            continue
        default = _field_default(f, defaults)
        if f.name not in old:
            # either default counts: a section the recipe leaves out takes the parent's default instance's value,
            # one it gives takes the class default for the keys it leaves out
            at_default = [d for d in (default, _field_default(f, None)) if d is not MISSING]
            if not any(_plain(d) == new[f.name] for d in at_default):
                return False
            continue
        was, now = old[f.name], new[f.name]
        nested = _nested_class(hints[f.name])
        args = typing.get_args(hints[f.name])
        item = args[0] if typing.get_origin(hints[f.name]) is list and args else None
        if nested is not None and isinstance(was, dict) and isinstance(now, dict):
            same = asks_the_same(was, now, nested, defaults=default if isinstance(default, nested) else None)
        elif dataclasses.is_dataclass(item) and isinstance(was, list) and isinstance(now, list):
            same = len(was) == len(now) and all(isinstance(a, dict) and isinstance(b, dict)
                                                and asks_the_same(a, b, item) for a, b in zip(was, now))
        else:
            same = was == now
        if not same:
            return False
    return True


def save_recipe(obj: Any, path: str | os.PathLike) -> None:
    """Write the resolved recipe as YAML (creating parent directories), in field order."""
    text = yaml.safe_dump(recipe_to_dict(obj), sort_keys=False, default_flow_style=False, allow_unicode=True)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("# resolved recipe written by ecomla\n" + text, encoding="utf-8")


def _yaml_inline(value: Any) -> str:
    text = yaml.safe_dump(_plain(value), default_flow_style=True, allow_unicode=True, width=10**9).strip()
    return text[:-4].strip() if text.endswith("\n...") else text  # drop the scalar document-end marker


def _nested_class(tp: Any) -> type | None:
    """The dataclass behind `Nested` or `Optional[Nested]`, if any."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(options) == 1 and dataclasses.is_dataclass(options[0]):
            return options[0]
    return None


def _describe_into(cls: type, prefix: str, defaults: Any, rows: list) -> None:
    fields, hints = _schema(cls)
    for f in fields:
        key = _join(prefix, f.name)
        default = _field_default(f, defaults)
        nested = _nested_class(hints[f.name])
        if default is MISSING:
            shown = "required"
        elif nested is not None and default is not None:
            shown = "{...}"  # its keys follow as their own rows
        else:
            shown = _yaml_inline(default)
        rows.append((key, _type_name(hints[f.name]), shown, f.metadata["help"]))
        if nested is not None:
            _describe_into(nested, key, default if isinstance(default, nested) else None, rows)


def describe_fields(cls: type) -> list[tuple[str, str, str, str]]:
    """(dotted key, type, YAML default or 'required', help) for every key, nested ones included."""
    rows: list[tuple[str, str, str, str]] = []
    _describe_into(cls, "", None, rows)
    return rows


def format_fields(cls: type, *, width: int = 100) -> str:
    """An aligned KEY / TYPE / DEFAULT / HELP listing for CLI epilogs; long help is wrapped."""
    rows = [("KEY", "TYPE", "DEFAULT", "HELP"), *describe_fields(cls)]
    wk, wt, wd = (max(len(r[i]) for r in rows) for i in range(3))
    lines = []
    for key, tp, default, help_ in rows:
        head = f"  {key:<{wk}}  {tp:<{wt}}  {default:<{wd}}  "
        if len(head) + len(help_) <= width or len(head) > width - 20:
            lines.append((head + help_).rstrip())
        else:
            lines.append(textwrap.fill(help_, width, initial_indent=head, subsequent_indent=" " * len(head)))
    return "\n".join(lines)
